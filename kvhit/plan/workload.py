"""``kvhit plan``'s workloads: requests ``(N, P)`` read from a file or drawn from distributions."""

import math
import random
from pathlib import Path


def read_workload(path):
    """Requests from a file: one per line, ``N`` (a repeat: ``P = N``) or ``N P``; ``#`` starts a comment."""
    requests = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) > 2:
            raise ValueError(f"{where}: expected 'N' or 'N P', got {line.strip()!r}")
        try:
            values = [int(f) for f in fields]
        except ValueError:
            raise ValueError(f"{where}: expected integers, got {line.strip()!r}") from None
        n, p = values[0], values[-1]
        if n < 1:
            raise ValueError(f"{where}: a prompt needs at least one token, got {n}")
        if not 0 <= p <= n:
            raise ValueError(f"{where}: the cached prefix {p} must be between 0 and the prompt length {n}")
        requests.append((n, p))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def parse_distribution(text, what):
    """A sampler ``rng -> int`` from ``fixed:X``, ``uniform:LO:HI``, ``normal:MEAN:SD``,
    ``lognormal:MEDIAN:SIGMA`` or ``choice:A,B,...``."""
    name, _, rest = text.partition(":")
    args = rest.split(":") if rest else []
    try:
        if name == "fixed" and len(args) == 1:
            x = int(args[0])
            return lambda rng: x
        if name == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if lo > hi:
                raise ValueError
            return lambda rng: rng.randint(lo, hi)
        if name == "normal" and len(args) == 2:
            mean, sd = float(args[0]), float(args[1])
            return lambda rng: round(rng.gauss(mean, sd))
        if name == "lognormal" and len(args) == 2:
            median, sigma = float(args[0]), float(args[1])
            return lambda rng: round(median * math.exp(rng.gauss(0, sigma)))
        if name == "choice" and len(args) == 1:
            values = [int(v) for v in args[0].split(",")]
            return lambda rng: rng.choice(values)
    except ValueError:
        pass
    raise ValueError(f"{what}: cannot read distribution {text!r} (fixed:X, uniform:LO:HI, normal:MEAN:SD, "
                     f"lognormal:MEDIAN:SIGMA, choice:A,B,...)")


def synthetic_workload(prefix, suffix, requests, seed):
    """``requests`` requests whose cached shared prefix ``P ~ prefix`` (at least 1) is followed by
    ``S ~ suffix`` new tokens (at least 0): ``N = P + S``. Seeded, so the same arguments give the same
    workload."""
    if requests < 1:
        raise ValueError(f"--requests must be positive, got {requests}")
    draw_p = parse_distribution(prefix, "--shared-prefix")
    draw_s = parse_distribution(suffix, "--suffix")
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        p = max(1, draw_p(rng))
        out.append((p + max(0, draw_s(rng)), p))
    return out
