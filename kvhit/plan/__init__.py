"""``kvhit plan``: rank the settings an operator controls by the cached tokens a workload gets.

A workload is a list of requests ``(N, P)``: ``N`` prompt tokens of which the first ``P`` were the whole
prompt of an earlier request on an empty cache (``P = N`` is the first repeat of that prompt, ``N > P`` a
longer sibling). The cache the request reads is what that earlier request left: the generated refimpl's
``request_writes`` under each policy's write side and the setting's retention interval, read through
``written_cache``; each hit is ``hit_tokens``. (``kvhit.written`` gives the same writes and the same
answers faster; its tests check it against those.) ``cache="dense"`` keeps the read side's assumption instead
(every state of the ``P`` tokens retained; ``kvhit.dense.DenseCache``).

A setting is what an operator can change without changing the model: ``--block-size`` for the groups that
follow it, ``prefix_match_unit``, lookahead versus drop for EAGLE/MTP, and the retention interval (None, 0
or a multiple of the scheduler block). Its memory cost is the retained-state count: ``retained_states``
of what the earlier request left, summed over the sliding-window and Mamba groups (Mamba states plus
sliding-window blocks), per request on average. Each setting costs a write side per distinct ``P`` and a
read per distinct ``(N, P)``, so every setting is first evaluated at vLLM's default retention interval 0
and the other intervals only for the best few (``retention_top``), both under the policy the ranking uses,
and the other two policies only for the settings a table prints (:func:`plan_settings`); on a large
workload the (setting, policy, range of ``P``) tasks run in forked worker processes (``evaluate``'s
``jobs``).

By concern: :mod:`.workload` (reading and drawing requests), :mod:`.settings` (the candidate settings),
:mod:`.evaluation` (the numbers and the ranking), :mod:`.output` (the table and JSON), :mod:`.plotting`
(``--plot``).
"""

from .evaluation import POLICIES, default_jobs, evaluate, hit_of, plan_settings, rank, retained_of
from .output import render, to_json
from .plotting import plot
from .settings import Candidates, Setting, candidates, with_retention
from .workload import parse_distribution, read_workload, synthetic_workload

__all__ = ["POLICIES", "Candidates", "Setting", "candidates", "default_jobs", "evaluate", "hit_of",
           "parse_distribution", "plan_settings", "plot", "rank", "read_workload", "render", "retained_of",
           "synthetic_workload", "to_json", "with_retention"]
