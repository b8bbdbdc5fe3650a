"""hgxserve: declarative LLM serving on bare-metal NVIDIA HGX hosts."""

__version__ = "0.1.0"
