"""kvhit's spec: one declarative model of vLLM's prefix-cache hit length, lowered to Z3 and to Python."""
