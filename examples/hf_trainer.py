"""A Hugging Face Trainer run (a tiny GPT-2 built from a config) made supervisable by trainwarden.

    torchrun --nproc_per_node=2 examples/hf_trainer.py --steps 400 --checkpoint-dir /tmp/ckpt

Nothing is downloaded: the model is built from a ``GPT2Config`` and the text is generated (a
seeded Markov chain over a 64-token vocabulary).  CPU/gloo by default, CUDA/NCCL where
available.  Takes the flags of ``train_ddp.py``; ``--hidden`` is the embedding width.
"""

from __future__ import annotations

import time
from typing import Any

import common
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from trainwarden.agent.integrations.hf import TrainwardenCallback
from trainwarden.agent.worker import init_distributed
from trainwarden.agent.worker.faults import FaultInjector

VOCAB, SEQ = 64, 32


class MarkovText(Dataset[dict[str, torch.Tensor]]):
    """``n`` token sequences of a fixed random Markov chain (each token has a few likely
    successors), so there is something to learn; ``split`` 0 trains, 1 is held out."""

    def __init__(self, seed: int, n: int, split: int) -> None:
        g = torch.Generator().manual_seed(20_000 + seed)
        succ = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
        probs = torch.tensor([0.75, 0.2, 0.05])
        g = torch.Generator().manual_seed(seed * 7 + split)
        seqs = torch.empty(n, SEQ, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for t in range(1, SEQ):
            pick = torch.multinomial(probs, n, replacement=True, generator=g)
            seqs[:, t] = succ[seqs[:, t - 1], pick]
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.seqs[i]
        return {"input_ids": ids, "labels": ids}


class Corrupt:
    """``--inject spike|nan``: the samples of the named global batches replaced by random
    tokens (a loss jump), or their labels all masked out (a NaN loss)."""

    def __init__(self, faults: FaultInjector) -> None:
        self.faults = faults

    def __call__(self, batch_index: int, sample: dict[str, torch.Tensor]) -> dict[str, Any]:
        for f in self.faults.data_faults(batch_index):
            ids = sample["input_ids"]
            if f.kind == "spike":
                g = torch.Generator().manual_seed(batch_index * 1_000_003 + int(ids.sum()))
                ids = torch.randint(0, VOCAB, ids.shape, generator=g)
                sample = {"input_ids": ids, "labels": ids}
            if f.kind == "nan":
                sample = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
        return sample


class ExampleHooks(TrainerCallback):
    """The example's own per-step work: injected process faults and the batch log."""

    def __init__(self, tw: TrainwardenCallback, faults: FaultInjector, log: common.BatchLog,
                 step_sleep: float) -> None:
        self.tw, self.faults, self.log, self.step_sleep = tw, faults, log, step_sleep

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.faults.before_step(state.global_step)
        if self.step_sleep:
            time.sleep(self.step_sleep)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        last = self.tw.last
        if last is not None:
            self.log.write(last.step, last.batch_index, last.lr or 0.0)
            self.faults.slowdown(last.step, self.tw.timer.compute_s or 0.0)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, data: MarkovText) -> float:
    model.eval()
    loss = float(model(input_ids=data.seqs, labels=data.seqs).loss)
    model.train()
    return loss


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--fsdp", action="store_true", help="FSDP2 through the Trainer's fsdp arguments, "
        "a shard per GPT-2 block"))
    if args.async_checkpoint:
        raise SystemExit("--async-checkpoint: the Trainer saves synchronously")
    torch.set_num_threads(1)
    info = init_distributed(timeout=args.timeout)  # before TrainingArguments: accelerate uses it
    common.setup_logging(info.rank)
    faults = FaultInjector(args.inject, rank=info.rank, world_size=info.world_size,
                           fired_dir=args.checkpoint_dir)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=args.hidden,
                                       n_layer=2, n_head=2, bos_token_id=0,
                                       eos_token_id=0))
    tw = TrainwardenCallback(retention_grace_s=args.retention_grace,
                             save_every_s=args.checkpoint_every,
                             config=vars(args) | {"inject": [str(f) for f in args.inject]})
    train = tw.dataset(MarkovText(args.seed, 8192, split=0), transform=Corrupt(faults))
    targs = TrainingArguments(
        output_dir=args.checkpoint_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=10, weight_decay=0.0, seed=args.seed,
        save_strategy="steps" if args.checkpoint_every_steps else "no",
        save_steps=args.checkpoint_every_steps or 500, save_total_limit=args.keep,
        train_sampling_strategy="sequential", ignore_data_skip=True,  # trainwarden's order
        logging_steps=100, report_to="none", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        **({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                           "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
           if args.fsdp else {}))
    log = common.BatchLog(args.batch_log, info.rank)
    trainer = Trainer(model=model, args=targs, train_dataset=train,
                      data_collator=default_data_collator,
                      callbacks=[tw, ExampleHooks(tw, faults, log, args.step_sleep)])
    common.declare_flops(model, args)

    t_start = time.time()
    resume_from = tw.resume_from_checkpoint()
    start = tw.session.resumed.start_step
    trainer.train(resume_from_checkpoint=resume_from)

    last_loss = tw.last.loss if tw.last is not None and tw.last.loss is not None else float("nan")
    final_train = common.mean_over_ranks(last_loss)
    final_eval = eval_loss(trainer.model, MarkovText(args.seed, 512, split=1))
    digest = common.weights_sha256(trainer.model)
    common.write_summary(args.summary_json, final_step=args.steps, final_train_loss=final_train,
                         final_eval_loss=final_eval, weights_sha256=digest,
                         attempt=info.attempt, started_at_step=start, resumed_from=resume_from,
                         skipped=[list(r) for r in tw.skipped], wall_s=time.time() - t_start,
                         fsdp=bool(trainer.is_fsdp_enabled),
                         parameters=type(next(trainer.model.parameters())).__name__)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
