"""kvbridge.worker."""
