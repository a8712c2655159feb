"""The committed split file: sizes, groups, strata, determinism, and clear errors for bad split files."""

import json
import subprocess
import sys

import pytest

from tau2_rl.data.make_splits import build_splits
from tau2_rl.domains import get_domain
from tau2_rl.envs.data import load_domain
from tau2_rl.envs.splits import GROUPS, SplitError, get_split, load_splits, split_for

AIRLINE, RETAIL = get_domain("airline"), get_domain("retail")

DOMAIN = load_domain(AIRLINE)
TASK_IDS = frozenset(DOMAIN.tasks)
SPLITS = AIRLINE.split_file()


def test_seed_split_sizes_and_groups():
    split = get_split("seed", SPLITS, task_ids=TASK_IDS)
    assert (len(split.train), len(split.test), len(split.covered)) == (40, 10, 16)
    assert set(split.test) <= set(DOMAIN.official_split["test"])  # test comes from tau2's official test list
    assert set(split.covered) <= set(DOMAIN.official_split["train"])
    sizes = {group: len(split.group(group)) for group in GROUPS}
    assert sizes == {"covered_seen": 16, "uncovered_seen": 24, "unseen": 10}
    assert sorted(t for g in GROUPS for t in split.group(g)) == sorted(TASK_IDS)
    for group in GROUPS:
        writes = [DOMAIN.tasks[t].writes for t in split.group(group)]
        assert any(writes) and not all(writes), f"{group} must hold write and no-write tasks"


def test_tau2_split_is_the_official_one():
    split = get_split("tau2", SPLITS, task_ids=TASK_IDS)
    assert set(split.train) == set(DOMAIN.official_split["train"])
    assert set(split.test) == set(DOMAIN.official_split["test"])
    assert split.covered == get_split("seed", SPLITS).covered
    assert split.group_of(split.test[0]) == "unseen"


@pytest.mark.parametrize("spec", [AIRLINE, RETAIL], ids=lambda spec: spec.name)
def test_committed_file_matches_the_procedure(spec):
    committed = json.loads(open(spec.split_file(), encoding="utf-8").read())
    assert committed == build_splits(spec)
    command = [sys.executable, "-m", "tau2_rl.data.make_splits", "--domain", spec.name, "--check"]
    result = subprocess.run(command, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_a_domains_split_names_and_groups_come_from_its_folder():
    """Retail's file holds τ²'s official split under its own name, with covered tasks drawn like the airline's: every
    group is populated, so a retail evaluation has a generalization figure."""
    retail = load_domain(RETAIL)
    split = split_for(retail)  # the domain's default
    assert split.name == RETAIL.default_split == "tau2" and split_for(DOMAIN).name == AIRLINE.default_split == "seed"
    official = retail.official_split
    assert set(split.train) == set(official["train"]) and set(split.test) == set(official["test"])
    sizes = {group: len(split.group(group)) for group in GROUPS}
    assert sizes == {"covered_seen": 30, "uncovered_seen": 44, "unseen": 40}
    with pytest.raises(SplitError, match=r"unknown split 'seed'.*valid splits: \['tau2'\] \(the retail domain\)"):
        split_for(retail, "seed")


def test_unknown_split_lists_valid_names():
    with pytest.raises(SplitError, match=r"valid splits: \['seed', 'tau2'\]"):
        get_split("bogus", SPLITS)


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "not valid JSON"),
        ('{"splits": {}}', "non-empty 'splits'"),
        ('{"splits": {"x": {"train": ["0"], "test": ["0"], "covered": []}}}', "both train and test"),
        ('{"splits": {"x": {"train": ["0"], "test": ["1"], "covered": ["2"]}}}', "subset of x.train"),
        ('{"splits": {"x": {"train": "0", "test": [], "covered": []}}}', "x.train must be a list"),
        ('{"splits": {"x": {"train": ["0", "999"], "test": ["1"], "covered": []}}}', "unknown task ids"),
    ],
)
def test_bad_split_file_names_the_problem(tmp_path, content, message):
    path = tmp_path / "splits.json"
    path.write_text(content)
    with pytest.raises(SplitError, match=message) as info:
        load_splits(str(path), TASK_IDS)
    assert str(path) in str(info.value)


def test_missing_split_file():
    with pytest.raises(SplitError, match="does not exist"):
        load_splits("/nonexistent/splits.json")
