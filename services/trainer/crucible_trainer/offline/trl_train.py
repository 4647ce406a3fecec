"""SFT and DPO with TRL's trainers on a LoRA policy, wired to a Crucible job.

The optimisation is TRL's own (`trl.SFTTrainer` with the loss on the completion tokens only,
`trl.DPOTrainer` with the loss types, beta and label smoothing of `crucible_shared.jobs.DPOConfig`);
this module only builds their inputs and connects them to the job:

* the model is Crucible's (`crucible_models.load_model`, so the built-in GGUF model trains from
  its dense copy) with a fresh LoRA from `ModelSpec`, or the starting adapter made trainable; its
  SDPA attention never takes cuDNN's kernels (`rl/attention.py`).
  DPO's reference is the starting policy: with a fresh LoRA TRL disables the adapter; with a
  starting adapter TRL keeps a frozen copy of it (the `ref` adapter) to score the reference.
* a `TrainerCallback` (`JobCallback`) sends each logged step's metrics to the job (metrics.jsonl,
  the event stream, W&B, the record's progress), stops training at the end of the step in which
  a cancel was requested, after saving a checkpoint, and reports each checkpoint.
* checkpoints are TRL's (`<work_dir>/checkpoint-N`, the two newest kept); a run whose work dir
  holds one resumes from it (optimizer, scheduler, RNG and data order included). A work dir made
  for other inputs (its `inputs.json` differs) is cleared first, so stale checkpoints never resume.
  A queued job's runs each have a work dir of their own and resume from the checkpoint the job's
  record points at (`run.resume_from`, `offline.attempts`); `hooks.gate` comes before each save
  and before the final adapter is put in place, `hooks.saved` commits each checkpoint.
* the final adapter (the trained LoRA alone, PEFT format) is written atomically to `adapter_dir`.

`train` blocks: jobs run it in a thread (`asyncio.to_thread`) while their event loop keeps
watching the cancel flag.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible_shared.jobs import DPOConfig, ModelSpec, OptimSpec, SFTConfig
from transformers import TrainerCallback

from crucible_trainer.offline.rows import COLUMNS
from crucible_trainer.runtime.atomic import output_dir
from crucible_trainer.runtime.cancel import Cancelled

_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


@dataclass
class Hooks:
    """How a training run talks to its job (all called from the training thread)."""

    metrics: Callable[[int, int, dict[str, float]], None] = lambda step, total, values: None
    event: Callable[..., None] = lambda kind, **data: None
    stop_requested: Callable[[], bool] = lambda: False
    # Fencing (`offline.attempts`): raise `Superseded` unless the run still holds the job, before
    # TRL saves a checkpoint and before the final adapter is put in place; and a saved checkpoint,
    # to commit as the one to resume from.
    gate: Callable[[], None] = lambda: None
    saved: Callable[[Path], None] = lambda checkpoint: None


@dataclass
class OfflineRun:
    """One SFT or DPO training run."""

    method: SFTConfig | DPOConfig
    model: ModelSpec
    optim: OptimSpec
    rows: list[dict[str, Any]]  # rows holding at least COLUMNS[method.name]
    work_dir: Path  # TRL's output_dir: checkpoints
    adapter_dir: Path  # the final adapter
    seed: int = 0
    checkpoint_every: int = 10
    start_adapter: str | None = None  # LoRA to continue from: the resolved init adapter, or a round's
    identity: str = ""  # hash of the inputs; checkpoints of other inputs are discarded
    resume_from: Path | None = None  # an earlier run's committed checkpoint (`offline.attempts`)
    step_offset: int = 0  # added to step numbers in metrics (the pipeline's later rounds)
    base_name: str | None = None  # the base the saved adapter names, when `model.base` is a snapshot
    result: dict[str, Any] = field(default_factory=dict)


def train(run: OfflineRun, hooks: Hooks) -> dict[str, Any]:
    """Train to the end (or to a cancel: `Cancelled`, after a checkpoint); returns a summary."""
    import datasets
    import trl
    from crucible_models import load_model
    from peft import PeftModel
    from transformers.trainer_callback import PrinterCallback

    from crucible_trainer.rl.attention import choose as choose_attention

    datasets.disable_progress_bars()
    _prepare_work_dir(run.work_dir, run.identity)
    if hooks.stop_requested():
        raise Cancelled()
    spec = run.model
    model, tokenizer = load_model(
        spec.base, device=spec.device, dtype=spec.dtype, attn_implementation=spec.attn_implementation
    )
    # Attention without cuDNN's kernels, as the online update's (rl/attention.py): its plans per
    # new shape, and the NaN gradients its backward gave some masked shapes, which a padded SFT or
    # DPO batch is (not timed on these trainers).
    choose_attention(model, cudnn=False)
    peft_config = None
    if run.start_adapter:
        model = PeftModel.from_pretrained(model, run.start_adapter, is_trainable=True)
    else:
        from crucible_trainer.rl.policy import lora_config

        peft_config = lora_config(spec)
    name = run.method.name
    dataset = datasets.Dataset.from_list([{c: row[c] for c in COLUMNS[name]} for row in run.rows])
    args = trainer_config(
        run, device=str(model.device), dtype=str(model.dtype).removeprefix("torch."), config=model.config
    )
    trainer_class = trl.SFTTrainer if name == "sft" else trl.DPOTrainer
    callback = JobCallback(hooks, run.step_offset)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[callback],
    )
    trainer.remove_callback(PrinterCallback)  # metrics go to the job, not to stdout
    resume = last_checkpoint(run.work_dir) or _same_inputs(run.resume_from, run.identity)
    if resume is not None:
        step = json.loads((resume / "trainer_state.json").read_text())["global_step"]
        hooks.event("resumed", step=run.step_offset + step, checkpoint=str(resume))
    output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if callback.stopped:
        raise Cancelled()
    with output_dir(run.adapter_dir) as tmp:
        # Only the trained adapter: DPO from a starting adapter also holds its frozen `ref` copy.
        if run.base_name:
            from crucible_trainer.rl.policy import name_base

            name_base(trainer.model, run.base_name)
        trainer.model.save_pretrained(tmp, selected_adapters=["default"])
        hooks.gate()  # only the run holding the job puts its adapter in place
    state = trainer.state
    run.result = {
        "steps": state.global_step,
        "rows": len(dataset),
        "epochs": state.epoch,
        "train_loss": output.training_loss,
        "resumed_from": None if resume is None else resume.name,
        "adapter": str(run.adapter_dir),
    }
    return run.result


def trainer_config(run: OfflineRun, *, device: str, dtype: str, config: Any = None) -> Any:
    """TRL's config for `run` (`trl.SFTConfig` or `trl.DPOConfig`); `auto` micro-batch and gradient
    checkpointing resolved for the device (`config`: the model's, for the memory estimate)."""
    import trl

    from crucible_trainer.runtime.hardware import offline_settings

    method, optim = run.method, run.optim
    micro, checkpointing = offline_settings(
        optim.micro_batch,
        run.model.gradient_checkpointing,
        device=device,
        config=config,
        tokens=method.max_length,
        rows_per_pair=2 if isinstance(method, DPOConfig) else 1,
        dtype_bytes=4 if dtype == "float32" else 2,
    )
    common: dict[str, Any] = {
        "output_dir": str(run.work_dir),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": optim.grad_accum or 1,
        "learning_rate": optim.lr,
        "weight_decay": optim.weight_decay,
        "max_grad_norm": optim.max_grad_norm or 0.0,  # 0: no clipping
        "warmup_steps": optim.warmup_steps,
        "lr_scheduler_type": _SCHEDULES[method.lr_schedule],
        "num_train_epochs": method.epochs,
        "max_steps": method.max_steps or -1,
        "max_length": method.max_length,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": run.checkpoint_every,
        "save_total_limit": 2,
        "report_to": "none",
        "disable_tqdm": True,
        "seed": run.seed,
        "data_seed": run.seed,
        "use_cpu": device == "cpu",
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "gradient_checkpointing": checkpointing,
        "dataloader_num_workers": 0,
    }
    if isinstance(method, SFTConfig):
        return trl.SFTConfig(**common, completion_only_loss=True, packing=False)
    return trl.DPOConfig(
        **common,
        beta=method.beta,
        loss_type=list(method.loss_type),
        loss_weights=method.loss_weights,
        label_smoothing=method.label_smoothing,
    )


def last_checkpoint(work_dir: Path) -> Path | None:
    """The newest complete TRL checkpoint (its trainer_state.json is written last)."""
    found = [
        p
        for p in work_dir.glob("checkpoint-*")
        if p.is_dir() and p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").exists()
    ]
    return max(found, key=lambda p: int(p.name.split("-")[-1])) if found else None


def _same_inputs(checkpoint: Path | None, identity: str) -> Path | None:
    """`checkpoint` if its folder was made for the same inputs (else None: not resumed from)."""
    if checkpoint is None:
        return None
    marker = checkpoint.parent / "inputs.json"
    same = marker.exists() and json.loads(marker.read_text()).get("identity") == identity
    return checkpoint if same else None


def _prepare_work_dir(work_dir: Path, identity: str) -> None:
    marker = work_dir / "inputs.json"
    if work_dir.exists() and (
        not marker.exists() or json.loads(marker.read_text()).get("identity") != identity
    ):
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"identity": identity}))


class JobCallback(TrainerCallback):
    """TRL's training loop -> the job: metrics, checkpoints, and the cancel flag."""

    def __init__(self, hooks: Hooks, step_offset: int = 0) -> None:
        self.hooks, self.offset, self.stopped = hooks, step_offset, False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "train_runtime" in logs:  # the end-of-training summary is in the result
            return
        values = {
            k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        self.hooks.metrics(self.offset + state.global_step, self.offset + state.max_steps, values)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.stopped and self.hooks.stop_requested():
            # Save where we are, then stop: a resumed run continues from this step.
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
        if control.should_save:  # TRL saves right after this: only while the run holds the job
            self.hooks.gate()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.hooks.saved(Path(args.output_dir) / f"checkpoint-{state.global_step}")
        self.hooks.event(
            "checkpoint",
            step=self.offset + state.global_step,
            path=f"{args.output_dir}/checkpoint-{state.global_step}",
        )
