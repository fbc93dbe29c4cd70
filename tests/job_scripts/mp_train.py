"""Pipeline × data-parallel training of the tests' transformer LM (``tests.modelparallel``, on
``PYTHONPATH``); rank 0 saves its losses and the gathered parameters."""

import os
from pathlib import Path

import torch
from tests.modelparallel.equivalence import Layout, train_layouts

(trained,) = train_layouts([Layout("lm")], steps=3)
if int(os.environ["RANK"]) == 0:
    assert trained is not None
    saved = {"losses": trained.losses, "params": trained.params}
    torch.save(saved, Path(os.environ["SM_MODEL_DIR"], "trained.pt"))
