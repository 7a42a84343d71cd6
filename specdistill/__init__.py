"""specdistill: train speculative-decoding draft heads (EAGLE-3, MTP), measure real acceptance, export for serving engines."""

__version__ = "0.1.0"
