"""transformers' ``Trainer`` on mixprec's engines: change one import.

::

    from mixprec.integrations.transformers import Trainer      # was: from transformers import Trainer
    trainer = Trainer(model=model, args=training_args, train_dataset=ds, ...)
    trainer.train()

and launch with ``mixprec launch --backend zero3 --nproc 2 run_clm.py ...`` (or a config file,
or ``Trainer(..., mixprec_config={"backend": "zero3"})``). :func:`mixprec_trainer` does the same
for any Trainer subclass (``mixprec_trainer(trl.SFTTrainer)``); ``Seq2SeqTrainer`` is exported.
docs/integrations/transformers.md says what maps where and what still differs.

[Note: the Trainer on mixprec]
The Trainer builds an ``accelerate.Accelerator`` in ``create_accelerator_and_postprocess`` and
drives it: ``prepare``, ``backward``, ``no_sync``, ``clip_grad_norm_``, ``gather_for_metrics``,
``gradient_state._set_sync_gradients`` (it prefetches its micro-batches and marks the last),
``optimizer_step_was_skipped``. The subclass builds a :class:`mixprec.Accelerator` there
instead, from the ``TrainingArguments`` that name mixprec settings (precision, data order,
accumulation plugin options) and mixprec's own config (backend, parallelism); arguments that
name another engine (``deepspeed=``, ``fsdp=``, ``parallelism_config``, a model loaded with a
``tp_plan``) are refused there, naming the mixprec key to use. The Trainer divides the loss by
its accumulation steps itself, so the Accelerator gets ``gradient_accumulation_steps=1`` (as
the stock Trainer gives Accelerate).

Checkpoints: the Trainer writes ``checkpoint-N`` with ``model.safetensors`` (``save_model``),
``optimizer.pt``, ``scheduler.pt``, ``rng_state_{rank}.pth`` and ``trainer_state.json``. Here
``save_model`` writes the whole model on every backend (the prepared model's
``save_pretrained`` streams a sharded one, every rank taking part), and the optimizer, RNG
and scaler files are replaced by mixprec's sharded checkpoint in ``checkpoint-N/mixprec``
(``save_state``: fp32 masters, optimizer shards, loss scaler, every rank's RNG and the
dataloader's position with the RNG of the batch it read ahead), which ``resume_from_checkpoint``
loads after ``prepare`` and which makes the resumed run continue bitwise. The scheduler stays
in ``scheduler.pt`` (the Trainer never prepares it). The Trainer's own data skip
(``skip_first_batches``) goes to the Accelerator's, which continues the checkpointed pass.

A ``checkpoint-N`` the stock Trainer wrote (no ``mixprec`` folder) resumes on the ddp and
single backends through the stock files (weights, ``optimizer.pt`` loaded into the prepared
optimizer, ``scheduler.pt``, RNG files); the other backends refuse it, naming what to do.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

try:
    import transformers
    import transformers.trainer as _trainer_module
    from transformers import Seq2SeqTrainer as _HfSeq2SeqTrainer
    from transformers import Trainer as _HfTrainer
except ImportError as e:  # the integration needs transformers; mixprec itself does not
    raise ImportError(
        f"mixprec.integrations.transformers needs transformers and accelerate ({e}); install them with "
        "`pip install 'mixprec[transformers]'` (or `pip install transformers accelerate`)") from e

from ..accelerator import Accelerator

__all__ = ["Seq2SeqTrainer", "Trainer", "mixprec_trainer", "MIXPREC_CHECKPOINT_DIR"]

MIXPREC_CHECKPOINT_DIR = "mixprec"  # checkpoint-N/mixprec: the Accelerator's save_state
_SCHEDULER_NAME = "scheduler.pt"
# Backends whose prepared model holds every parameter whole on every rank: the stock
# Trainer's model and optimizer files load as they are.
_LOCAL_BACKENDS = ("single", "ddp")


class MixprecTrainerMixin:
    """What :func:`mixprec_trainer` puts in front of a Trainer class (see the module docstring)."""

    _mixprec_trainer = True

    def __init__(self, *args: Any, mixprec_config: Any = None, **kwargs: Any) -> None:
        self._mixprec_config = mixprec_config
        self._mixprec_resume: Optional[str] = None  # "mixprec" or "stock" while resuming
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------ the Accelerator
    def create_accelerator_and_postprocess(self) -> None:
        args = self.args
        _refuse_other_engines(args, self.model)
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

        acc_cfg = args.accelerator_config.to_dict()
        grad_acc = dict(acc_cfg.pop("gradient_accumulation_kwargs") or {})
        if "num_steps" in grad_acc:
            if args.gradient_accumulation_steps > 1:
                raise ValueError(
                    f"accelerator_config.gradient_accumulation_kwargs['num_steps']={grad_acc['num_steps']} and "
                    f"gradient_accumulation_steps={args.gradient_accumulation_steps} both set the accumulation; "
                    "keep one (TrainingArguments.gradient_accumulation_steps)"
                )
            args.gradient_accumulation_steps = grad_acc["num_steps"]
        grad_acc["num_steps"] = 1  # the Trainer divides the loss itself
        loader_cfg = DataLoaderConfiguration(
            **{k: acc_cfg.pop(k) for k in ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")})
        loader_cfg.data_seed = args.data_seed
        loader_cfg.non_blocking = acc_cfg.pop("non_blocking")
        handlers = _ddp_handlers(args)
        mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        self.accelerator = Accelerator(
            mixed_precision=mixed, gradient_accumulation_steps=1, cpu=True if args.use_cpu else None,
            config=self._mixprec_config, dataloader_config=loader_cfg,
            gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_acc), kwargs_handlers=handlers or None,
        )
        self.gather_function = self.accelerator.gather_for_metrics
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    # ------------------------------------------------------------ training
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.args.torch_compile and not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # Accelerate compiles in prepare(); mixprec leaves compiling to the caller: do it here.
            model = torch.compile(model, backend=self.args.torch_compile_backend or "inductor",
                                  mode=self.args.torch_compile_mode)
            self.model_wrapped = model
        return model, train_dataloader

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        self._mixprec_train_loader = loader
        return loader

    @contextlib.contextmanager
    def _training_loaders_only(self):
        """save_state/load_state see the training dataloader only: the Trainer prepares a new
        eval dataloader at every evaluate(), and their number differs between the saving
        run and the resumed one (which has not evaluated yet)."""
        loaders = self.accelerator._dataloaders
        every = list(loaders)
        loaders[:] = [d for d in every if d is getattr(self, "_mixprec_train_loader", None)]
        try:
            yield
        finally:
            loaders[:] = every

    def _inner_training_loop(self, *args: Any, **kwargs: Any):
        # The Trainer skips the batches a resumed epoch already trained with Accelerate's
        # skip_first_batches, a module global of transformers.trainer: the Accelerator's own
        # continues the pass load_state positioned (and skips plainly for a stock checkpoint).
        with _patched(_trainer_module, "skip_first_batches", self.accelerator.skip_first_batches):
            return super()._inner_training_loop(*args, **kwargs)

    # Tensor and sequence parallelism: the Trainer counts the loss's tokens over every rank
    # and divides by the ranks that share a batch (get_tp_size() * get_sp_size()).
    def get_tp_size(self) -> int:
        mesh = getattr(self.accelerator, "mesh", None)
        return 1 if mesh is None else mesh.tp_size

    def get_sp_size(self) -> int:
        mesh = getattr(self.accelerator, "mesh", None)
        return 1 if mesh is None else mesh.sp_size

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if self.get_sp_size() > 1 and isinstance(inputs, dict) and "input_ids" in inputs:
            inputs = self._sequence_slice(inputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _sequence_slice(self, inputs: dict, num_items_in_batch) -> dict:
        """Under sequence parallelism each rank of an SP group runs its slice of the sequence
        (``prepare_sp_inputs``: labels shifted before slicing, positions of the whole
        sequence); the loss is normalised by the Trainer's token count over the whole batch,
        which the model must accept (``num_items_in_batch``)."""
        if "labels" in inputs and (num_items_in_batch is None or not self.model_accepts_loss_kwargs):
            raise NotImplementedError(
                "sequence parallelism under the Trainer needs a model whose forward takes loss kwargs "
                "(num_items_in_batch) and TrainingArguments(average_tokens_across_devices=True): each rank holds a "
                "slice of the sequence, so a per-slice mean is not the whole sequence's loss")
        keys = ("input_ids", "labels", "position_ids", "attention_mask")
        batch = self.accelerator.prepare_sp_inputs(*(inputs.get(k) for k in keys))
        batch.pop("num_items_in_batch", None)  # the Trainer passes its own (the same count)
        return {**{k: v for k, v in inputs.items() if k not in keys}, **batch}

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus mixprec's fp16 loss scale and skipped-step count beside the
        loss (every rank skips the same steps: the overflow check is collective)."""
        if "loss" in logs and self.accelerator.mixed_precision == "fp16":
            logs["loss_scale"] = self.accelerator.loss_scale
            logs["skipped_steps"] = self.accelerator.skipped_steps
        return super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------ saving
    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.accelerator._state_is_local(self.model) or state_dict is not None:
            return super()._save(output_dir, state_dict=state_dict)
        # A sharded model: every rank takes part in the streamed save_pretrained; the main
        # process writes the files, then the tokenizer and the arguments as the stock _save does.
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        self.accelerator.unwrap_model(self.model, keep_torch_compile=False).save_pretrained(
            output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with self._training_loaders_only():
            self.accelerator.save_state(os.path.join(output_dir, MIXPREC_CHECKPOINT_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing: the RNG states are in checkpoint-N/mixprec (every rank's, and those of the
        batch the loader read ahead, which the Trainer's files miss)."""

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the fp16 loss scaler is in checkpoint-N/mixprec."""

    # ------------------------------------------------------------ resuming
    def _resume_kind(self, checkpoint: str) -> str:
        if os.path.isdir(os.path.join(checkpoint, MIXPREC_CHECKPOINT_DIR)):
            return "mixprec"
        backend = self.accelerator.backend
        if backend not in _LOCAL_BACKENDS or getattr(self.accelerator, "mesh", None) is not None:
            weights_only = not os.path.isfile(os.path.join(checkpoint, transformers.trainer.OPTIMIZER_NAME))
            what = ("holds the weights only (saved with save_only_model=True?)" if weights_only else
                    "was written by the stock Trainer (no mixprec/ folder); its optimizer.pt holds whole optimizer "
                    "states, which mixprec loads on the ddp and single backends only")
            raise NotImplementedError(
                f"resume_from_checkpoint={checkpoint!r}: this checkpoint {what}, not on {backend!r}"
                f"{' with tensor/sequence parallelism' if backend in _LOCAL_BACKENDS else ''}. Fix: resume it once "
                f"with `mixprec launch --backend ddp` and let the Trainer save a checkpoint, then switch backends; or "
                f"start a new run from its weights with from_pretrained({checkpoint!r})"
            )
        return "stock"

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Called before prepare() with the stock weights; a mixprec checkpoint's weights (the
        # fp32 masters) come with load_state after prepare().
        if self._resume_kind(resume_from_checkpoint) == "stock":
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        self._mixprec_resume = self._resume_kind(checkpoint)
        if self._mixprec_resume == "stock":
            return super()._load_optimizer_and_scheduler(checkpoint)
        with self._training_loaders_only():
            self.accelerator.load_state(os.path.join(checkpoint, MIXPREC_CHECKPOINT_DIR))
        path = os.path.join(checkpoint, _SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or self._resume_kind(checkpoint) == "mixprec":
            return  # load_state restored every generator, at the point the run saved them
        return super()._load_rng_state(checkpoint)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        """Nothing: load_state restored the loss scaler with the rest."""

    def _load_best_model(self) -> None:
        """The best checkpoint's weights (its ``model.safetensors``, or the index of its
        shards) into the prepared model: every rank reads the file (memory-mapped) inside
        ``gathered_parameters(writeback=True)`` and writes back the part it owns, fp32
        masters included; the optimizer state stays, as in the stock Trainer."""
        from ..checkpoint.mapped import MappedSafetensors, checkpoint_files

        best = self.state.best_model_checkpoint
        transformers.trainer.logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        reader = MappedSafetensors(checkpoint_files(best))
        with self.accelerator.gathered_parameters(model, writeback=True):
            result = model.load_state_dict({k: reader.tensor(k) for k in reader.keys()}, strict=False)
        del reader
        self._issue_warnings_after_load(result)


def _patched(module: Any, name: str, value: Any):
    @contextlib.contextmanager
    def scope():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, old)
    return scope()


def _refuse_other_engines(args: Any, model: Any) -> None:
    """Arguments that hand the model to another engine: refused, naming mixprec's key."""
    named = []
    if getattr(args, "deepspeed", None):
        named.append(("deepspeed", args.deepspeed,
                      "`mixprec launch --backend zero1|zero2|zero3` (or `mixprec config import` your DeepSpeed "
                      "JSON: docs/configuration.md)"))
    if getattr(args, "fsdp", None):
        named.append(("fsdp", args.fsdp, "`mixprec launch --backend fsdp` (or `zero3`)"))
    if getattr(args, "parallelism_config", None) is not None:
        named.append(("parallelism_config", args.parallelism_config,
                      "the config keys `tensor_parallel.size` / `sequence_parallel.size` (docs/tensor_parallel.md)"))
    if (getattr(model, "tp_size", None) or 1) > 1 or getattr(model, "is_distributed_loading_by_transformers", False):
        named.append(("from_pretrained(tp_plan=...)", getattr(model, "tp_plan", None),
                      "load the model whole (or under accelerator.init_empty_weights()) and set `tensor_parallel.size`"))
    if named:
        what = "; ".join(f"{k}={v!r}: use {fix}" for k, v, fix in named)
        raise ValueError(
            f"mixprec's Trainer drives mixprec's engines; these arguments give the model to another engine: {what}. "
            "Remove them from TrainingArguments and choose the backend in mixprec's config "
            "(docs/integrations/transformers.md)")


def _ddp_handlers(args: Any) -> list:
    """The DDP options the user set in TrainingArguments (the stock Trainer's defaults, e.g.
    ``find_unused_parameters=True`` for any PreTrainedModel, are left to the ddp engine,
    which finds unused parameters itself)."""
    given = {"find_unused_parameters": args.ddp_find_unused_parameters, "bucket_cap_mb": args.ddp_bucket_cap_mb,
             "broadcast_buffers": args.ddp_broadcast_buffers}
    options = {k: v for k, v in given.items() if v is not None}
    if not options:
        return []
    from accelerate.utils import DistributedDataParallelKwargs
    return [DistributedDataParallelKwargs(**options)]


def mixprec_trainer(cls: type) -> type:
    """``cls`` (transformers' ``Trainer`` or any subclass: ``Seq2SeqTrainer``, TRL's
    ``SFTTrainer``, your own) on mixprec's engines: a subclass of the same name whose
    constructor also takes ``mixprec_config=`` (a dict, file path or MixprecConfig, as
    ``Accelerator(config=...)``)::

        SFTTrainer = mixprec_trainer(trl.SFTTrainer)
    """
    if not isinstance(cls, type) or not issubclass(cls, _HfTrainer):
        raise TypeError(f"mixprec_trainer({cls!r}): expected transformers.Trainer or a subclass of it")
    if getattr(cls, "_mixprec_trainer", False):
        return cls
    return type(cls.__name__, (MixprecTrainerMixin, cls),
                {"__module__": __name__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


Trainer = mixprec_trainer(_HfTrainer)
Seq2SeqTrainer = mixprec_trainer(_HfSeq2SeqTrainer)
