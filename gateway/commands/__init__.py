"""The command line's commands: preflight, canary, demo, and the process supervisor behind --workers."""
