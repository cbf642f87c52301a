"""kvbridge.bootstrap."""
