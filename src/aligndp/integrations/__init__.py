"""aligndp inside the trainers people already use ([Note: trainer integrations]).

- :mod:`aligndp.integrations.lightning`: ``AlignDPStrategy``, a PyTorch Lightning strategy.
- :mod:`aligndp.integrations.hf`: ``AlignDPTrainer``, a Hugging Face ``transformers.Trainer``.

Each module imports its trainer package when it is imported; ``import aligndp`` imports
neither (install the ``lightning`` or ``hf`` extra).

[Note: trainer integrations]
The trainer keeps its loop, data, logging and callbacks; aligndp replaces two things it
builds: the data-parallel wrapper (``aligndp.parallelize`` instead of torch DDP) and the
optimizer. The optimizer follows the user's: by default the one the trainer would have built
(its class, param groups and every option, lr included) is rebuilt by ``parallelize`` over
aligndp's buffers, and the trainer's lr schedulers are moved onto it; ``optimizer="muon"``
(or any name ``parallelize`` takes) replaces the class and keeps the user's lr unless
``lr=`` is given. Checkpoints go through the trainer's own save and resume calls, written as
an aligndp (DCP) checkpoint beside the trainer's own state, so ZeRO-1's sharded optimizer
state is saved by every rank and resumes at any dp size.
"""
