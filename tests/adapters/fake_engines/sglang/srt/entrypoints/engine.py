"""``sglang/srt/entrypoints/engine.py``: ``Engine`` and its process layout.

``Engine(**kwargs)`` loads the plugins, builds ``ServerArgs`` and runs ``_launch_subprocesses``: the start
method is set to ``spawn``; one ``run_scheduler_process`` per TP rank (args ``server_args, port_args, gpu_id,
tp_rank, attn_cp_rank, moe_dp_rank, moe_ep_rank, pp_rank, dp_rank, pipe_writer``), then the detokenizer
(``run_detokenizer_process(server_args, port_args)``), then the ``TokenizerManager`` in this process, after
which it waits for every scheduler's init info. ``dp_size > 1`` (the data-parallel controller) is not faked.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import run_scheduler_process
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import PortArgs, ServerArgs


class Engine:
    def __init__(self, **kwargs: Any):
        load_plugins()
        self.server_args = kwargs["server_args"] if "server_args" in kwargs else ServerArgs(**kwargs)
        if self.server_args.dp_size != 1:
            raise NotImplementedError("the fake SGLang has no data-parallel controller")
        self.tokenizer_manager, self.all_child_pids = self._launch_subprocesses(self.server_args)

    @classmethod
    def _launch_subprocesses(cls, server_args: ServerArgs) -> tuple[TokenizerManager, list[int]]:
        load_plugins()
        mp.set_start_method("spawn", force=True)
        procs, readers, conns = [], [], []
        for tp_rank in range(server_args.tp_size):
            reader, writer = mp.Pipe(duplex=False)
            ours, theirs = mp.Pipe()
            port_args = PortArgs(scheduler_conn=theirs)
            proc = mp.Process(
                target=run_scheduler_process,
                args=(server_args, port_args, tp_rank, tp_rank, 0, 0, 0, 0, None, writer),
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            readers.append(reader)
            conns.append(ours)
        detokenizer = mp.Process(target=run_detokenizer_process, args=(server_args, PortArgs()))
        detokenizer.start()
        tokenizer_manager = TokenizerManager(server_args, PortArgs(), scheduler_conns=conns)
        for proc, reader in zip(procs, readers, strict=True):
            if not reader.poll(300) or reader.recv().get("status") != "ready":
                raise RuntimeError(f"Rank scheduler died during initialization (exit code: {proc.exitcode})")
        return tokenizer_manager, [p.pid for p in procs] + [detokenizer.pid]

    def get_all_child_pids(self) -> list[int]:
        return list(self.all_child_pids)

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        stream: bool = False,
        routed_dp_rank: int | None = None,
        rid: str | None = None,
    ) -> dict[str, Any]:
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid, routed_dp_rank=routed_dp_rank
        )
        return await self.tokenizer_manager.generate_request(obj, None).__anext__()  # type: ignore[no-any-return]
