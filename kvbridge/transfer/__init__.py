"""kvbridge.transfer."""
