"""A real `ringd local` ring: N daemons and their launcher, as OS processes on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from devkit import REPO, RING_START_TIMEOUT_S, TEST_PREFILL_CHUNK
from devkit.procs import stop_group, wait_for_line

# How long a ring's launcher gets to stop its nodes on SIGTERM before the group is killed.
RING_STOP_GRACE_S = 15.0


class Ring:
    """A `ringd local` process tree: N daemons and their launcher."""

    def __init__(
        self, model: Path, nodes: int, split: list[int] | None = None, env: dict | None = None, model_id: str = "tiny", tensor_parallel: int = 1,
        tensor_engine: str | None = None, extra: list[str] | None = None,
    ):
        self.model, self.nodes, self.split, self.model_id = model, nodes, split, model_id
        self.log = tempfile.NamedTemporaryFile(prefix="ringd-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "ringd", "local", "--nodes", str(nodes), "--model", str(model), "--port", "0", "--model-id", model_id]
        if split:
            cmd += ["--split", ",".join(map(str, split))]
        if tensor_parallel > 1:
            cmd += ["--tensor-parallel", str(tensor_parallel)]
        if tensor_engine is not None:
            cmd += ["--tensor-engine", tensor_engine]
        cmd += extra or []
        full_env = {**os.environ, "RINGD_PREFILL_CHUNK_TOKENS": str(TEST_PREFILL_CHUNK), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        try:
            line = wait_for_line(self.proc, "OpenAI API at ", RING_START_TIMEOUT_S)
        except AssertionError as e:
            self.stop()
            raise RuntimeError(f"ring of {self.nodes} did not start: {e}\n{self.logs()[-4000:]}") from None
        self.ready_line = line
        return line.split("OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="not-needed", max_retries=0, timeout=120, **kwargs)

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        stop_group(self.proc, RING_STOP_GRACE_S)
        if self.proc.stdout:
            self.proc.stdout.close()
