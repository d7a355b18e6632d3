"""The Strategy runtime: what every training mode implements, one process at a time.

Its *topology* (topology.py) says who is who from configuration alone; this class joins
the run (``setup``, ``teardown``: the groups it holds are a ``GroupLease``), wraps the
model (``prepare``, ``unwrap``), takes one step (``train_step``), reads its replica's
slice of each global batch (``distribute``), reduces for metrics (``all_reduce_sum``),
counts (``stats``, ``step_counters``) and gives its *state* to the checkpointer
(``state_dict``), which it never calls. What only some modes do is a role of its own
(roles.py: a server, a remote view, model files). The Trainer's loop calls only these
methods: a new mode is a new class in the STRATEGIES table, never a branch in the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from paratrain.config import DEFAULT_TIMEOUT_S
from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError, DivergedError
from paratrain.session.diagnosis import timeout_culprits
from paratrain.session.exits import leave_at_exit
from paratrain.session.teardown import GroupLease
from paratrain.strategies import evaluation
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.device import default_device
from paratrain.strategies.local_step import local_step
from paratrain.strategies.numerics import finite_gradients, finite_parameters
from paratrain.strategies.recipe import StepRecipe, check_step_options, clip_norm
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import uncompiled
from paratrain.strategies.topology import Role, Topology

if TYPE_CHECKING:
    from paratrain.checkpoints.files import RunCheckpoints, StateWriter
    from paratrain.config import TrainConfig
    from paratrain.strategies.roles import FitLoop, ModelFiles, Remote, Server

_CURRENT: ContextVar[Strategy | None] = ContextVar("paratrain_strategy", default=None)


def current_strategy() -> Strategy | None:
    """The strategy of the innermost ``with strategy.scope():``, if any."""
    return _CURRENT.get()


class Strategy:
    """Base of every training mode; the default methods are those of one plain replica."""

    name: ClassVar[str] = "base"
    takes_compression: ClassVar[bool] = False
    """Whether the mode sends gradients that a codec (``--compression``) can compress."""
    scales_loss: ClassVar[bool] = True
    """Whether the optimizer runs where the gradient is made, as fp16's GradScaler needs."""
    scaler_missing: ClassVar[str] = ""  # why fp16's GradScaler cannot serve this mode's gradients
    compiles: ClassVar[bool] = True
    """Whether ``torch.compile`` of the prepared model works under this mode."""
    reshards: ClassVar[bool] = False
    """Whether a checkpoint of this mode resumes on another number of replicas."""
    takes_channels_last: ClassVar[bool] = True
    """Whether parameters may be in channels-last memory order (FSDP2 shards only contiguous ones)."""
    checkpoints_in_background: ClassVar[bool] = True
    """Whether a process's checkpoint part can be written from a thread (``--checkpoint-async``;
    a model in files of its own through ``model_files.start_save``): not by shards that serve."""

    def __init__(self, device: str = "auto", timeout: float = DEFAULT_TIMEOUT_S, workers: int | None = None):
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"workers must be a whole number >= 1, got {workers!r}")
        self.device_preference = device
        self.timeout = timeout
        self.workers = workers
        """Processes that train, for ``paratrain.launch(fn, strategy=...)`` to start; None:
        as many as the process group this strategy joins has."""
        self.device = torch.device("cpu")
        self.topology: Topology = Topology()
        """Who is who in this run; set by ``setup`` from the process group."""
        self.process_rank = 0
        """This process's global rank in the run (0..num_processes-1)."""
        self._ready = False
        self._lease = GroupLease()  # the groups this strategy formed or wrapped (session/teardown.py)
        self._exit_hook = False
        self._steps = 0  # updates applied
        self.steps_taken = 0
        """Training steps this process took, skipped ones included: the step number of errors."""
        self.on_nan = "stop"
        """``"stop"``: a NaN or Inf loss ends the run (DivergedError, exit 3); ``"skip"``: an
        update whose gradient holds one is skipped and counted (``skipped_updates``)."""
        self.skipped_updates = 0
        self.recipe = StepRecipe()
        """How a step computes (precision, accumulation, clipping); set by ``prepare``."""
        self.scaler: torch.amp.GradScaler | None = None
        self.wait_seconds = 0.0
        """Seconds this process spent blocked on other processes (parameter-server pulls)."""
        self.on_version: Callable[[int], None] = _ignore
        """Called with each parameter version this process publishes (a parameter-server
        shard) or receives (a parameter-server worker): the Trainer points it at its
        callbacks' ``on_version``, so checkpoints and fault drills can follow versions."""

    # ----- configuration and topology ----------------------------------------------------
    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        """The topology of ``num_replicas`` replicas, one process each (the default layout)."""
        return Topology(num_replicas=num_replicas)

    @classmethod
    def topology_for(cls, config: TrainConfig) -> Topology:
        """Who is who in a run of ``config``: one replica per worker by default."""
        return cls.topology_of(config.workers)

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """ConfigError for settings this mode cannot run that no single option's own checks
        can see (an option against the number of workers, say)."""

    @classmethod
    def check_model(cls, model: nn.Module, config: TrainConfig) -> None:
        """ConfigError if the mode cannot run this model as configured; called in the
        launching process before any worker starts."""

    @classmethod
    def from_config(cls, config: TrainConfig) -> Strategy:
        return cls(**process_options(config))

    def planned_topology(self) -> Topology:
        """Who is who in the run this object was made for (its ``workers`` and its mode's
        own sizes): the processes ``paratrain.launch(fn, strategy=self)`` starts."""
        return self.topology_of(self.workers or 1)

    def __getstate__(self) -> dict[str, Any]:
        """A strategy travels to the processes of a launch before it joins a run."""
        if self._ready:
            raise TypeError(f"{self.name}: a strategy that has joined a run cannot be sent to another process")
        return dict(self.__dict__)

    def describe(self) -> dict[str, Any]:
        """The metrics file's description of this mode."""
        return {
            "strategy": self.name,
            "workers": self.num_replicas,
            "ps_shards": 0,
            "backup_workers": 0,
            "compression": "none",
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """Join the run (idempotent). Subclasses call ``super().setup()`` last.

        A strategy that has joined a run leaves it at interpreter exit if nobody called
        ``teardown`` before: a script that ends without it neither hangs (parameter-server
        shards wait for the chief's word) nor aborts (Gloo's threads outliving Python)."""
        if not self._exit_hook:
            leave_at_exit(self.teardown)
            self._exit_hook = True
        if self.workers is not None and self.planned_topology().num_processes != self.topology.num_processes:
            planned = self.planned_topology().num_processes
            raise ConfigError(
                f"{self.name} with workers={self.workers} needs {planned} processes, "
                f"the process group has {self.topology.num_processes}"
            )
        self._ready = True

    @property
    def role(self) -> Role:
        """``Role.WORKER`` for processes that train; parameter-server shards are ``Role.PS``."""
        return self.topology.role(self.process_rank)

    @property
    def rank(self) -> int:
        """This process's replica (the slice of each global batch it reads), 0..num_replicas-1;
        on a parameter-server shard, its shard index. ``process_rank`` is the global rank."""
        return self.topology.replica(self.process_rank)

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def is_chief(self) -> bool:
        """The chief (worker 0) prints, evaluates for the log, and writes files."""
        return self.process_rank == self.topology.chief_rank

    @property
    def stands_in_for_chief(self) -> bool:
        """Whether this process reports the run (to its launcher, not in files) where the
        chief is lost after the last step: a fault-tolerant run's every replica."""
        return False

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """``with strategy.scope():`` models and tensors made inside land on its device,
        and a Trainer made inside uses this strategy."""
        self.setup()
        token = _CURRENT.set(self)
        try:
            with default_device(self.device):
                yield self
        finally:
            _CURRENT.reset(token)

    def _join_group(self, backend: str) -> None:
        """Join the default process group (or form it: then teardown destroys it)."""
        self._lease.join(backend, self.timeout)

    def teardown(self) -> None:
        """Leave the run so that no process group outlives it (session/teardown.py says why).
        Idempotent; called at interpreter exit too."""
        self._lease.release()
        self._ready = False

    def track(self, wrapper: Any) -> Any:
        """Note an object ``prepare`` made that holds process groups (a DDP or FSDP model, a
        pipeline schedule), to release at teardown."""
        return self._lease.track(wrapper)

    # ----- model -------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this replica's device and wrap it for this mode; ``recipe``
        says how its steps compute (precision, accumulation, clipping, memory format)."""
        self.setup()
        self.use_recipe(recipe)
        return self.recipe.prepare_model(model.to(self.device)), optimizer

    @classmethod
    def check_step(cls, name: str, precision: str, compile: bool = False, channels_last: bool = False) -> None:
        """ConfigError for step options this mode cannot run (``name``: the mode's name)."""
        check_step_options(cls, name, precision, compile, channels_last)

    def use_recipe(self, recipe: StepRecipe | None) -> None:
        """Take ``recipe`` (ConfigError where this mode cannot run it)."""
        recipe = recipe or StepRecipe()
        self.check_step(self.name, recipe.precision, channels_last=recipe.channels_last)
        self.recipe = recipe
        self.scaler = torch.amp.GradScaler(self.device.type) if recipe.scaled else None

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Backward passes without communication (all but the last of an accumulated step)."""
        return contextlib.nullcontext()

    def reduce_gradients(self, model: nn.Module) -> None:
        """Average this step's gradient over the replicas, in a mode that does it after the
        backward pass rather than in it (DDP does it in it: nothing to do by default)."""

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Evaluation runs inside: a mode whose replicas differ between synchronizations puts
        the model they share in place (and its own back after)."""
        yield

    def clip_gradients(self, model: nn.Module) -> None:
        """Scale this step's gradient to the recipe's global norm; the norm is the whole
        model's (every replica holds the whole gradient here)."""
        clip_norm(self.unwrap(model).parameters(), self.recipe.clip_grad_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever ``prepare`` (and ``torch.compile``) wrapped it in."""
        return uncompiled(model)

    def when_model_made(self, load: Callable[[], None]) -> None:
        """Run ``load`` (a checkpoint's model and optimizer state read into them) once this
        process's model is made: here at once; a pipeline that cuts its stage at the first
        batch runs it then."""
        load()

    #: ``train_step(model, loss_fn, optimizer, inputs, targets)``: forward, backward (over the
    #: recipe's micro-batches) and update on this replica's batch (local_step.py).
    train_step = local_step

    def count_update(self, updates: int = 1) -> None:
        """More updates applied (``stats`` and checkpoints count them)."""
        self._steps += updates

    def skip_nonfinite(self, model: nn.Module, loss: torch.Tensor | float, finite: Callable[[], bool]) -> bool:
        """The one path for a NaN or Inf gradient, in every strategy: with ``on_nan="skip"``,
        whether ``finite()`` says this step's update must be skipped (counted in
        ``skipped_updates``); DivergedError, naming this step, if the parameters themselves
        are no longer finite (nothing left to skip back to). ``finite`` must give the same
        answer on every process that applies the update. ``loss`` is what the error reports
        (a pipeline stage without the loss passes NaN)."""
        if self.on_nan != "skip" or finite():
            return False
        self.skipped_updates += 1
        if not self.parameters_finite(model):
            raise DivergedError(float(loss), self.steps_taken)
        return True

    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every gradient the optimizer would apply is finite."""
        return finite_gradients(optimizer)

    def parameters_finite(self, model: nn.Module) -> bool:
        return finite_parameters(model)

    def diagnose(self, error: RuntimeError, step: int) -> Exception | None:
        """A clearer error for ``error``, raised by a collective at ``step``: on a timeout,
        which ranks did not answer (each rank still alive says so in the store; the silent
        ones are named). None to let ``error`` stand."""
        return timeout_culprits(error, step, self.timeout, self.describe_rank)

    def describe_rank(self, global_rank: int) -> str:
        return self.topology.rank_name(global_rank)

    #: ``forward(model, inputs)``: evaluation's outputs, None where a process holds none;
    #: ``score(model, inputs, targets, loss_fn, metrics)``: their loss and metrics;
    #: ``evaluation_sums(data, batch_size, sums_of)``: a data set's, over replicas (evaluation.py).
    forward = evaluation.forward
    score = evaluation.score
    evaluation_sums = evaluation.evaluation_sums

    def step_counters(self) -> dict[str, float]:
        """This process's running totals, read after every step by the TensorBoard logger:
        ``bytes_sent`` (its own sends), ``wait_seconds``, and ``staleness`` of its last
        gradient as far as this process can see it (0 for synchronous modes)."""
        return {"bytes_sent": 0, "wait_seconds": self.wait_seconds, "staleness": 0}

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def begin_fit(self, trainer: FitLoop) -> None:
        """Called by ``Trainer.fit`` once its callbacks began (and a checkpoint may have set
        the loop's position): a mode whose replicas join a running job takes the live
        position here (``trainer.load_state_dict``)."""

    def finish(self, model: nn.Module) -> None:
        """End of training on this process (parameter-server workers report done)."""

    @property
    def evaluates(self) -> bool:
        """Whether this process takes part in evaluation (all replicas, unless a mode says not)."""
        return True

    # ----- roles beyond one replica (roles.py) --------------------------------------------
    @property
    def server(self) -> Server | None:
        """This process's server role, where it serves instead of training (a parameter-server shard)."""
        return None

    @property
    def remote(self) -> Remote | None:
        """This process's view of state another holds (a parameter-server worker)."""
        return None

    def state_writer(self, files: RunCheckpoints, loop: FitLoop) -> StateWriter | None:
        """How this process's state goes into checkpoints where its role writes its own
        (checkpoints/files.py: a parameter-server shard or worker); None: a training
        replica's part at steps (train/checkpoint.py)."""
        return None

    @property
    def model_files(self) -> ModelFiles | None:
        """Where the mode writes the model and optimizer in its own form (fsdp); None: whole,
        into the model part of the checkpoint."""
        return None

    # ----- data --------------------------------------------------------------------------
    def distribute(
        self, dataset: object, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ) -> ShardedBatches:
        """This replica's batches of ``dataset`` (``batch_size`` is per replica), or the whole
        global batches where the topology says every replica reads them."""
        self.setup()
        whole = self.topology.whole_batches
        return ShardedBatches(
            dataset,
            batch_size * self.num_replicas if whole else batch_size,
            num_replicas=1 if whole else self.num_replicas,
            rank=0 if whole else self.rank,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            device=self.device,
        )

    # ----- reductions, accounting, state ---------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over replicas, in place; returns it."""
        return tensor

    def stats(self) -> dict[str, Any]:
        """Communication and staleness counters, summed over ranks (call on every rank)."""
        return {
            "bytes_sent": 0,
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: self._steps * self.num_replicas}),
        }

    def state_dict(self) -> dict[str, Any]:
        """This process's state for a checkpoint (the checkpointer calls it); under fp16, the
        gradient scaler's scale and growth count (a resumed run skips the steps the run never
        stopped skips)."""
        scaler = self.scaler.state_dict() if self.scaler is not None else {}
        return {"name": self.name, "steps": self._steps, "skipped_updates": self.skipped_updates, "scaler": scaler}

    def reshard_state(self, state: dict[str, Any], saved_replicas: int) -> dict[str, Any]:
        """This process's strategy state from a checkpoint written by ``saved_replicas``
        replicas (a mode that ``reshards``): what still holds with this run's replicas."""
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ConfigError(f"checkpoint was written by strategy {state.get('name')!r}, this run uses {self.name!r}")
        self._steps = int(state["steps"])
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.steps_taken = self._steps + self.skipped_updates
        if state.get("scaler") and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _ignore(version: int) -> None:
    pass
