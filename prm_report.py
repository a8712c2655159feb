"""PRM-Lite's rule tables and calibration reports (``tau2_rl/evaluation/prm_report.py``; docs/prm_lite.md).

python prm_report.py --trajectories results.json [more.json ...]     # real agents' τ² results: the report
python prm_report.py --trajectories chat.json --task_map map.json    # τ-bench v1's chat format
python prm_report.py --update-docs docs/prm_lite.md                  # regenerate the page's generated sections
python prm_report.py --markdown                                      # the rule tables
"""

from tau2_rl.evaluation.prm_report import main

if __name__ == "__main__":
    raise SystemExit(main())
