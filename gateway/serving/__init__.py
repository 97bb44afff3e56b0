"""The gateway as a service: its models, its requests in flight, its place in the fleet, and the admit-to-dispatch flow."""
