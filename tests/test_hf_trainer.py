"""AlignDPTrainer against Hugging Face's own Trainer (torch DDP through accelerate), on 2 gloo
ranks ([Note: trainer integrations]): a tiny GPT-2 with its tied head, the Trainer's own
AdamW (no decay on biases and LayerNorms), linear schedule and clipping give the same logged
losses and grad norms and the same params; a run saved at ``save_steps`` and resumed by
``train(resume_from_checkpoint=)`` continues as the uninterrupted run does.

The ranks are tests/_dist.py's gloo world, which accelerate finds initialised."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402

from aligndp.integrations.hf import AlignDPTrainer  # noqa: E402
from tests._dist import case, make_tests  # noqa: E402
from tests.models import ADAMW_GAIN, assert_close, ckpt, order_tolerance  # noqa: E402

STEPS = 4
BATCH, SEQ, VOCAB = 4, 16, 64  # per rank


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def dataset(ws: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, VOCAB, (STEPS * BATCH * ws, SEQ), generator=g)
    return [{"input_ids": r, "labels": r} for r in rows]


class Logged(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def train(cls, ws: int, out: str, *, resume=None, save_steps=None, **extra):
    for key, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank())):
        os.environ[key] = str(value)
    os.environ["WORLD_SIZE"] = str(ws)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # read, not used: the group exists
    os.environ.setdefault("MASTER_PORT", "29500")
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=1,
        max_grad_norm=0.5,  # clips: the early grad norms are above it
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    logged = Logged()
    model = gpt2()
    trainer = cls(model=model, args=args, train_dataset=dataset(ws), callbacks=[logged], **extra)
    trainer.train(resume_from_checkpoint=resume)
    return model, logged.logs


def tolerance() -> float:
    # the longest sum: a weight gradient over the tokens of both ranks; AdamW; the loss and
    # the grad norm weigh elements by their size
    return order_tolerance(terms=2 * BATCH * SEQ, steps=STEPS, gain=ADAMW_GAIN)


@case(2)
def case_losses_match_the_trainers_ddp(rank, ws):
    out = ckpt(f"hf-trainer-{rank}")
    theirs, their_logs = train(transformers.Trainer, ws, out + "-ddp")
    assert len(their_logs) == STEPS
    for sharding in ("none", "zero1"):
        ours, our_logs = train(AlignDPTrainer, ws, f"{out}-{sharding}", sharding=sharding)
        for key in ("loss", "grad_norm"):
            assert_close(
                torch.tensor([log[key] for log in our_logs]),
                torch.tensor([log[key] for log in their_logs]),
                f"{sharding} {key}",
                tolerance(),
            )
        assert [log["learning_rate"] for log in our_logs] == [
            log["learning_rate"] for log in their_logs
        ]
        assert max(log["grad_norm"] for log in our_logs) > 0.5  # clipping was exercised
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert_close(p.detach(), q.detach(), f"{sharding} {name}", tolerance())


@case(2)
def case_checkpoint_saved_and_resumed_through_the_trainer(rank, ws):
    out = ckpt("hf-trainer-resume")
    whole, whole_logs = train(AlignDPTrainer, ws, out, save_steps=2, sharding="zero1")
    path = os.path.join(out, "checkpoint-2")
    assert os.path.isdir(os.path.join(path, "aligndp"))
    rest, rest_logs = train(AlignDPTrainer, ws, out + "-rest", resume=path, sharding="zero1")
    assert [log["loss"] for log in rest_logs] == [log["loss"] for log in whole_logs[2:]]
    assert [log["learning_rate"] for log in rest_logs] == [
        log["learning_rate"] for log in whole_logs[2:]
    ]
    for p, q in zip(rest.parameters(), whole.parameters()):
        assert torch.equal(p, q)


make_tests(globals())
