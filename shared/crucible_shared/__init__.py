"""Crucible's shared package: protocol models, settings bases and clients used by every service.

It never imports torch or vLLM, so the gateway and the sandbox stay light.
"""

__version__ = "0.1.0"
