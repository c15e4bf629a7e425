"""specchat: a local chat app that shows speculative decoding as it happens."""

__version__ = "0.1.0"
