"""kvgate: prefix-cache identity for LoRA adapters that change, as a gateway in front of vLLM."""

__version__ = "0.1.0"
