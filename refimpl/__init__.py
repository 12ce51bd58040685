"""kvhit's generated reference implementation (see policy.py). DO NOT EDIT: `make gen`."""

from .policy import *  # noqa: F401,F403
from .policy import (ALL_POLICIES, CacheState, Group, Junction, Kind, Layout, Mode, Replay, Rules, Sizes,
                     SpecGroup, Speculation, as_cache, derive_sizes, hit, hit_tokens, policy_rules,
                     sizes_for)
