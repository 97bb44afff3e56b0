"""The gateway as a service: its models, requests in flight, place in the fleet, and the admit-to-dispatch flow."""
