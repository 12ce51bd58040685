"""Concrete helpers the policy needs at run time.

Codegen copies this module into ``refimpl`` as it is: it is the Python meaning of the operators that are
not a one-line expression (the candidate scan) and of the layout arithmetic (lcm, gcd).
"""

import math


def max_aligned(step, hi, pred):
    """The largest ``x = k * step`` with ``0 < x <= hi`` and ``pred(x)``, or 0 if there is none."""
    x = hi // step * step
    while x > 0:
        if pred(x):
            return x
        x -= step
    return 0


def lcm_all(values):
    """Least common multiple of positive integers."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def gcd_all(values):
    """Greatest common divisor of positive integers."""
    out = 0
    for v in values:
        out = math.gcd(out, v)
    return out
