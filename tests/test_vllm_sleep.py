"""A colocated sleep-mode vLLM engine stays awake for a whole multi-turn rollout (not woken and synced per wave).

vLLM is not installed on CPU machines, so the engine is a recording stand-in with VLLMGeneration's attributes; the
names themselves are pinned against TRL's source in tests/test_trl_hooks.py.
"""

from types import SimpleNamespace

from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer


class RecordingEngine:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.calls.append(("sleep", level))


def make_trainer(enable_sleep_mode=True, mode="colocate"):
    calls = []
    generation = SimpleNamespace(mode=mode, enable_sleep_mode=enable_sleep_mode, _llm_weights_sleeping=True)
    generation.llm = RecordingEngine(calls)

    def sync_weights():
        calls.append(("sync_weights",))
        generation._llm_weights_sleeping = False

    generation.sync_weights = sync_weights
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=generation, state=SimpleNamespace(global_step=3))
    trainer._last_loaded_step = 2
    return trainer, generation, calls


def test_engine_is_synced_and_woken_once_and_put_back_to_sleep():
    trainer, generation, calls = make_trainer()
    with MultiTurnGRPOTrainer._vllm_awake_for_rollout(trainer):
        assert generation.enable_sleep_mode is False  # TRL's generate() then neither wakes nor sleeps per wave
        calls.append(("wave",))
        calls.append(("wave",))
    assert calls == [("sync_weights",), ("wake_up", ("kv_cache",)), ("wave",), ("wave",), ("sleep", 2)]
    assert generation.enable_sleep_mode is True and generation._llm_weights_sleeping is True
    assert trainer._last_loaded_step == 3  # no second sync inside _generate_single_turn


def test_engine_goes_back_to_sleep_when_the_rollout_fails():
    trainer, generation, calls = make_trainer()
    try:
        with MultiTurnGRPOTrainer._vllm_awake_for_rollout(trainer):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert calls[-1] == ("sleep", 2) and generation.enable_sleep_mode is True


def test_nothing_happens_without_sleep_mode_or_in_server_mode():
    for kwargs in ({"enable_sleep_mode": False}, {"mode": "server"}):
        trainer, _, calls = make_trainer(**kwargs)
        with MultiTurnGRPOTrainer._vllm_awake_for_rollout(trainer):
            pass
        assert calls == []
