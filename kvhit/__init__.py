"""kvhit: vLLM's prefix-cache hit length, made explicit and checked.

Packages: ``kvhit.spec`` (the model), ``kvhit.proofs`` (Z3 invariants), ``kvhit.refimpl`` (generated
from the spec), ``kvhit.adapters`` (the vLLM plugin).
"""

__version__ = "0.1.0"
