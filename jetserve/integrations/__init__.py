"""Integrations with other serving systems (optional extras): Ray Serve."""
