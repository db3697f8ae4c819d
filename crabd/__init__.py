"""crabd: a host daemon that makes AI-agent sandboxes recoverable."""

__version__ = "0.1.0"
