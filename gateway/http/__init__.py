"""The HTTP edge: the server, the routes, a request's way in, and the relay to the client."""
