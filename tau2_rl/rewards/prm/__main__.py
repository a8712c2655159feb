"""``python -m tau2_rl.rewards.prm``: PRM-Lite's rule table and calibration report (``report.main``).

``--update-docs docs/prm_lite.md`` regenerates both in docs/prm_lite.md, ``--markdown`` prints the table,
``--calibration`` the report.
"""

from tau2_rl.rewards.prm.report import main

if __name__ == "__main__":
    raise SystemExit(main())
