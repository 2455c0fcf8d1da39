"""Worker classes (``--worker-cls``) whose model runner is NELSSA's (V1 runner family).

On CUDA the V1 model runner is used deliberately (VLLM_USE_V2_MODEL_RUNNER=0): it is the runner vLLM
uses on CPU too, so one code path serves both, and it lets a step with offloaded rows run its
attention eagerly (piecewise graphs) while other steps keep full CUDA graphs.
"""

from __future__ import annotations

import torch

from nelssa.vllm_plugin.connector import step_host_ends
from nelssa.vllm_plugin.runner import NelssaRunnerMixin


def _cpu_classes():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    class NelssaCPUModelRunner(NelssaRunnerMixin, CPUModelRunner):
        pass

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
            # steps with offloaded rows must run attention eagerly (piecewise): a full graph
            # would replay the captured stock kernel instead of the split-batch wrapper
            if self._nelssa_so is not None and self._nelssa_has_offloaded(self._nelssa_so):
                kwargs["use_cascade_attn"] = True  # forbids FULL graphs only
            return super()._determine_batch_execution_and_padding(*args, **kwargs)

        @staticmethod
        def _nelssa_has_offloaded(so) -> bool:
            return any(step_host_ends(so.kv_connector_metadata).values())

    class NelssaGPUWorker(Worker):
        def init_device(self):
            super().init_device()
            if self.use_v2_model_runner:
                raise ValueError("NELSSA needs vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
            self.model_runner = NelssaGPUModelRunner(self.vllm_config, self.device)

    return NelssaGPUModelRunner, NelssaGPUWorker


def __getattr__(name):  # the classes of one platform only are built (each imports its vLLM worker)
    for kind, make in (("CPU", _cpu_classes), ("GPU", _gpu_classes)):
        if name in (f"Nelssa{kind}ModelRunner", f"Nelssa{kind}Worker"):
            runner, worker = make()
            globals().update({f"Nelssa{kind}ModelRunner": runner, f"Nelssa{kind}Worker": worker})
            return globals()[name]
    raise AttributeError(name)
