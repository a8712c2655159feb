"""``telecom-workflow``: τ²'s telecom domain under its workflow policy (``tau2 run --domain telecom-workflow``).

τ² registers it as a domain of its own whose tasks, tools, databases and user are telecom's; only the policy differs:
the main policy joined with ``tech_support_workflow.md`` (a step-by-step troubleshooting workflow) in place of
``tech_support_manual.md``, and the environment's name. So it is telecom's spec with those fields replaced: the
same split file, scripted parties and PRM terms; ``--domain telecom-workflow`` trains, evaluates and compares with
τ²'s harness as ``--domain telecom`` does.
"""

from __future__ import annotations

import dataclasses

from tau2_rl.domains import telecom

SPEC = dataclasses.replace(
    telecom.SPEC,
    name="telecom-workflow",
    module=__name__,
    release=telecom.SPEC.release.replace("manual policy", "workflow policy"),
    files=tuple(name.replace("tech_support_manual", "tech_support_workflow") for name in telecom.FILES),
    policy_files=("main_policy.md", "tech_support_workflow.md"),
    environment=telecom.environment_named("telecom-workflow"),
    variant_of="telecom",
)
