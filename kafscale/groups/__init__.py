"""Consumer-group coordination."""
