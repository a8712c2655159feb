"""The private GRPOTrainer hooks MultiTurnGRPOTrainer overrides or calls must exist with the signatures we rely on
(trl is pinned to 1.16.0; a TRL upgrade that moves them fails here, not in the middle of a training run)."""

import inspect

import trl
from trl import GRPOTrainer

from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

EXPECTED = {
    "_generate": ["self", "prompts"],
    "_generate_single_turn": [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ],
    "_generate_and_score_completions": ["self", "inputs"],
    "_compute_loss": ["self", "model", "inputs"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
}


def test_trl_version_is_pinned():
    assert trl.__version__ == "1.16.0"


def test_private_hooks_have_expected_signatures():
    for name, params in EXPECTED.items():
        method = getattr(GRPOTrainer, name, None)
        assert method is not None, f"GRPOTrainer.{name} disappeared"
        assert list(inspect.signature(method).parameters) == params, name


def test_generate_returns_the_eight_tuple_we_build():
    # _generate_and_score_completions unpacks exactly eight values from _generate
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "tool_images,\n        ) = self._generate(prompts)" in source
    assert "self.mask_truncated_completions" in source
    # _compute_loss multiplies the completion mask by tool_mask: environment tokens (tool_mask 0) get no loss
    assert 'completion_mask * inputs["tool_mask"]' in inspect.getsource(GRPOTrainer._compute_loss)


def test_luspo_aggregation_and_two_dimensional_advantages_are_supported():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'self.loss_type == "luspo"' in source
    assert "advantages.dim() == 1" in source or "if advantages.dim()" in source


def test_subclass_overrides_only_the_documented_hooks():
    overridden = {
        name
        for name, value in vars(MultiTurnGRPOTrainer).items()
        if callable(value) and hasattr(GRPOTrainer, name) and not name.startswith("__")
    }
    assert overridden == {
        "_generate",
        "_generate_and_score_completions",
        "training_step",
        "compute_loss",
        "_get_grad_norm",
        "evaluate",
        "get_batch_samples",
        "_load_optimizer_and_scheduler",
    }


def test_the_optimizer_state_goes_to_args_device_under_several_processes_through_a_cached_device():
    """``_load_optimizer_and_scheduler`` swaps ``TrainingArguments``' cached device for ``cpu`` while transformers
    loads the optimiser state of a multi-process CPU run (``cpu:<rank>`` cannot be restored to)."""
    import functools

    from transformers import Trainer, TrainingArguments

    source = inspect.getsource(Trainer._load_optimizer_and_scheduler)
    assert 'map_location = self.args.device if self.args.world_size > 1 else "cpu"' in source
    assert isinstance(inspect.getattr_static(TrainingArguments, "_setup_devices"), functools.cached_property)
    assert "return self._setup_devices" in inspect.getsource(TrainingArguments.device.fget)


def test_the_importance_sampling_code_generation_ahead_feeds_reads_only_these_flags():
    """``_behaviour_correction`` raises ``use_vllm`` around TRL's scoring and loss: TRL must compute the proximal
    log-probs, the token-level weight and the loss product under exactly that condition, and nowhere else read
    ``use_vllm`` after ``_generate`` has returned."""
    from transformers import Trainer

    assert list(inspect.signature(Trainer.get_batch_samples).parameters) == [
        "self", "epoch_iterator", "num_batches", "device"]  # fmt: skip
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    after_generate = scoring[scoring.index("= self._generate(prompts)") :]
    condition = "self.use_vllm and self.vllm_importance_sampling_correction"
    assert after_generate.count("self.use_vllm") == after_generate.count(condition) == 4
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert loss.count("self.use_vllm") == 1
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss


def test_a_user_error_step_can_drop_its_gradients_before_the_optimizer_step():
    # compute_loss(model, inputs, return_outputs, num_items_in_batch) runs before the backward; _get_grad_norm runs
    # after it and right before optimizer.step(), where gradients set to None make the optimiser skip every weight
    assert list(inspect.signature(GRPOTrainer.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"
    ]  # fmt: skip
    source = inspect.getsource(GRPOTrainer._run_epoch)
    hook = source.index("grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)")
    assert hook < source.index("self.optimizer.step()", hook)


def test_grad_norm_hook_receives_the_pre_clip_norm():
    # transformers' loop: grad_norm = self._clip_grad_norm(model) (returns the pre-clip norm), then
    # grad_norm = self._get_grad_norm(model, grad_norm=grad_norm); the override logs what it returns
    assert list(inspect.signature(GRPOTrainer._get_grad_norm).parameters) == ["self", "model", "grad_norm"]
    source = inspect.getsource(GRPOTrainer._run_epoch)
    assert "grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)" in source


def test_vllm_sleep_mode_attributes_we_toggle_exist():
    # MultiTurnGRPOTrainer._vllm_awake_for_rollout keeps a colocated sleep-mode engine awake for a whole rollout by
    # toggling these private attributes of trl.generation.vllm_generation.VLLMGeneration.
    from trl.generation import vllm_generation

    source = inspect.getsource(vllm_generation.VLLMGeneration)
    for needle in (
        "self.enable_sleep_mode",
        "self._llm_weights_sleeping",
        "def sync_weights(self)",
        'wake_up(tags=["kv_cache"])',
        "self.llm.sleep(level=2)",
    ):
        assert needle in source, needle
    assert "_last_loaded_step" in inspect.getsource(GRPOTrainer._generate_single_turn)


def test_on_cpu_the_fused_head_scores_only_the_labelled_positions_with_the_same_log_probs():
    """``tau2_rl.trainers.fused_head``: TRL's fused LM head takes its "only labelled rows" branch from
    ``trl.trainer.utils._use_triton``; switched on for CPU, the labelled positions get the log-probabilities (and
    entropies, and input gradients) of the every-position branch, and the others 0 as before."""
    import torch
    import trl.trainer.utils as trl_utils
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tau2_rl.trainers.fused_head import score_labelled_positions_on_cpu

    source = inspect.getsource(trl_utils.add_fused_lm_head)
    assert "compact = _use_triton(hidden_states.device)" in source and "hidden_states[mask] if compact" in source
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, 512, (3, 12))
    attention = torch.ones_like(ids)
    attention[0, :4] = 0  # left padding
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :5] = -100  # the prompt

    def score() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
        return out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()

    saved = trl_utils._use_triton
    trl_utils._use_triton = getattr(saved, "trl_choice", saved)  # TRL's own (a trainer built earlier switched it)
    try:
        every = score()
        assert trl_utils._use_triton(torch.device("cpu")) is False  # TRL's own choice on CPU
        score_labelled_positions_on_cpu()
        score_labelled_positions_on_cpu()  # idempotent
        assert trl_utils._use_triton(torch.device("cpu")) is True
        assert trl_utils._use_triton(torch.device("meta")) is False  # other devices: TRL's choice
        labelled = score()
    finally:
        trl_utils._use_triton = saved
    valid = labels[:, 1:] != -100
    assert valid.sum() > 0 and (~valid).sum() > 0
    for a, b in zip(every, labelled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (labelled[0][~valid] == 0).all() and (labelled[0][valid] != 0).all()
    from tau2_rl.trainers.sft import ShardedSFTTrainer  # both trainers switch it before building their heads

    for trainer in (MultiTurnGRPOTrainer, ShardedSFTTrainer):
        assert "score_labelled_positions_on_cpu()" in inspect.getsource(trainer.__init__), trainer
