"""``NeuronDiffusionWorker``: vLLM-Omni's diffusion worker, with each call's modelled
Trainium time read (``metrics.RequestClock``) and offered over Omni's collective RPC."""
from __future__ import annotations

from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

from . import metrics


class NeuronDiffusionWorker(DiffusionWorker):
    def init_device(self) -> None:
        super().init_device()
        self.modelled = metrics.RequestClock(self.device, publish=self.rank == 0)

    def _timed(self, requests: int, run, *args, **kwargs):
        self.modelled.begin()
        out = run(*args, **kwargs)
        self.modelled.end(requests)
        return out

    def execute_model(self, req, od_config, *args, **kwargs):
        # Omni's start-up warm-up (a 512x512 dummy request) is not serving.
        if getattr(req, "is_dummy_run", lambda: False)():
            return super().execute_model(req, od_config, *args, **kwargs)
        return self._timed(1, super().execute_model, req, od_config, *args, **kwargs)

    def execute_model_batch(self, scheduler_output, od_config):
        return self._timed(len(scheduler_output.scheduled_new_reqs),
                           super().execute_model_batch, scheduler_output, od_config)

    def execute_stepwise(self, scheduler_output):
        # One denoising step of requests that span several calls: its time counts, but no
        # request ends here.
        return self._timed(0, super().execute_stepwise, scheduler_output)

    def modelled_summary(self) -> dict:
        """The modelled cost so far (``Omni(...).engine.collective_rpc("modelled_summary")``)."""
        return self.modelled.summary.as_dict()

    def reset_modelled_summary(self) -> None:
        self.modelled.reset()
