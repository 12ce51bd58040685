"""Single checks of the default run's configurations, each in a fresh process, for the composition tests."""

from kvhit.proofs import runner
from kvhit.proofs.domains import configs
from kvhit.proofs.model import check, isolated_map
from kvhit.spec.policy import ALL_POLICIES

CFGS = configs(extended=False)


def index(label: str) -> int:
    """The index in ``CFGS`` of the configuration labelled ``label``."""
    return next(i for i, c in enumerate(CFGS) if c.label == label)


def _check(task):
    invariant, policy, i = task
    verdict, _, cex, _ = check(runner.BY_NAME[invariant], ALL_POLICIES[policy], CFGS[i])
    return task, (verdict, cex)


def checks(tasks) -> dict:
    """``{(invariant, policy, index): (verdict, cex)}``, each check in a fresh process, two at a time."""
    return dict(isolated_map(_check, list(tasks), 2))
