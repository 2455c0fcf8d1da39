"""Worker classes (``--worker-cls``) whose model runner is NELSSA's (V1 runner family).

On CUDA the V1 model runner is used deliberately (VLLM_USE_V2_MODEL_RUNNER=0): it is the runner vLLM
uses on CPU too, so one code path serves both, and it lets a step with offloaded rows run its
attention eagerly (piecewise graphs) while other steps, those with lane rows too, keep full CUDA graphs.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from nelssa.config import NelssaConfig, engine_config
from nelssa.vllm_plugin import sm_split
from nelssa.vllm_plugin.runner import NelssaRunnerMixin

log = logging.getLogger("vllm.nelssa")


def hardware_queues(cfg: NelssaConfig | None) -> str | None:
    """CUDA, the lane on: ask for ``lane_connections`` hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS,
    read when this process's CUDA context is made) -> the value set, or None when left alone. Each host
    wait of a lane graph (a memory-op or host-function node) holds the head of its queue until the host
    answers; with CUDA's default 8 queues for the lane graph's ~30 internal streams and the step's, a
    step stream sharing such a queue stood 22-35 ms once per lane batch (H200 profile, docs/results.md)."""
    if cfg is None or not cfg.lane or cfg.lane_connections <= 0 or "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return None
    if torch.cuda.is_initialized():
        log.warning("NELSSA lane: CUDA is already initialised in this process; CUDA_DEVICE_MAX_CONNECTIONS=%d "
                    "cannot take effect (set it in the environment)", cfg.lane_connections)
        return None
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(cfg.lane_connections)
    return os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]


def step_stream(cfg: NelssaConfig | None, device: torch.device) -> None:
    """CUDA: the engine's steps on a stream of ``cfg.step_priority`` (< 0: above the hand-off's side stream,
    which has torch's lowest priority 0). vLLM steps, captures and replays its graphs on its "current
    stream" (``vllm.utils.torch_utils.current_stream``, a stream of its own made on first use, priority 0);
    ``torch.cuda.set_stream`` (vLLM keeps track of it) on this thread, before the model runner is built,
    makes ours that stream. The runner logs the priority its steps run at (runner.load_model)."""
    if sm_split.setup(cfg, device):  # config lane_sms: the step stream of the steps' SMs (sm_split.py, 1)
        return
    if cfg is None or cfg.step_priority == 0:
        return
    torch.cuda.set_stream(torch.cuda.Stream(device, priority=cfg.step_priority))


def _cpu_classes():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    class NelssaCPUModelRunner(NelssaRunnerMixin, CPUModelRunner):
        """A seeded request (SamplingParams.seed, the OpenAI ``seed``) whose sampled token a step discards
        (a prefill chunk that is not its last): vLLM 0.26 rewinds its generator by 4 Philox offsets, which a
        CPU generator does not have ("CPU Generator does not use offset": the engine dies, NELSSA_OFF
        too). Here such a generator's state is kept before the sampling and restored after it, the same
        rewind (the sampled token never happened); vLLM's own loop does not see these generators."""

        def _sample(self, *args, **kwargs):
            gens = self.input_batch.generators
            discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0].tolist()
            self._nelssa_rewind = {i: gens[i].get_state() for i in discarded
                                   if i in gens and gens[i].device.type == "cpu"}
            return super()._sample(*args, **kwargs)

        def _bookkeeping_sync(self, *args, **kwargs):
            rewind, self._nelssa_rewind = getattr(self, "_nelssa_rewind", {}), {}
            gens = self.input_batch.generators
            held = {i: gens.pop(i) for i in rewind}
            try:
                return super()._bookkeeping_sync(*args, **kwargs)
            finally:
                for i, g in held.items():
                    g.set_state(rewind[i])
                    gens[i] = g

    class NelssaCPUWorker(CPUWorker):
        def init_device(self):
            super().init_device()
            if self.use_v2_model_runner:
                raise ValueError("NELSSA needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
            self.model_runner = NelssaCPUModelRunner(self.vllm_config, torch.device("cpu"))

    return NelssaCPUModelRunner, NelssaCPUWorker


def _gpu_classes():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class NelssaGPUModelRunner(NelssaRunnerMixin, GPUModelRunner):
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            # steps with split rows must run attention eagerly (piecewise): a full graph would replay
            # the captured stock kernel instead of the split-batch wrapper. Lane rows need no wrapper
            # (shrunk in the step's buffers, runner._prepare_inputs): such steps keep full graphs.
            step = self._nelssa_step
            if self._nelssa_so is not None and step is not None and step[0].rows:
                kwargs["use_cascade_attn"] = True  # forbids FULL graphs only
            return super()._determine_batch_execution_and_padding(*args, **kwargs)

    class NelssaGPUWorker(Worker):
        def init_device(self):
            cfg = engine_config(self.vllm_config)
            if hardware_queues(cfg) is not None:
                log.info("NELSSA lane: CUDA_DEVICE_MAX_CONNECTIONS=%s", os.environ["CUDA_DEVICE_MAX_CONNECTIONS"])
            super().init_device()
            if self.use_v2_model_runner:
                raise ValueError("NELSSA needs vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
            step_stream(cfg, self.device)
            self.model_runner = NelssaGPUModelRunner(self.vllm_config, self.device)

    return NelssaGPUModelRunner, NelssaGPUWorker


def __getattr__(name):  # the classes of one platform only are built (each imports its vLLM worker)
    for kind, make in (("CPU", _cpu_classes), ("GPU", _gpu_classes)):
        if name in (f"Nelssa{kind}ModelRunner", f"Nelssa{kind}Worker"):
            runner, worker = make()
            globals().update({f"Nelssa{kind}ModelRunner": runner, f"Nelssa{kind}Worker": worker})
            return globals()[name]
    raise AttributeError(name)
