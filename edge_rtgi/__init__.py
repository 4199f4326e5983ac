"""edge-rtgi: an on-device runtime for real-time voice and speech translation."""

__version__ = "0.1.0"
