"""The fault kvgate exists to prevent, reproduced on vLLM alone (no kvgate involved).

Same adapter name and path, new bytes, reloaded in place: the warm answer reuses prefix blocks
computed with the old weights and disagrees with a cold run of the new version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from gateway.core.wire import cold_salt
from gateway.dev.vllm_process import VllmProcess
from gateway.proof.experiment import complete, long_prompt
from tests.vllm.conftest import post_json

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_inplace_reload_serves_stale_prefix_blocks(
    vllm_replicas: list[VllmProcess], http: aiohttp.ClientSession, fixture_dir: Path, tmp_path: Path
) -> None:
    url = vllm_replicas[1].url
    mutable = tmp_path / "tenant"
    shutil.copytree(fixture_dir / "adapters" / "v1", mutable)
    name, prompt = "direct-tenant", long_prompt()
    await post_json(http, f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(mutable)})
    try:
        v1_cold = await complete(http, url, name, prompt)
        v1_warm = await complete(http, url, name, prompt)
        assert v1_cold.cached_tokens == 0
        assert v1_warm.cached_tokens >= 384
        assert v1_warm.agrees_with(v1_cold)  # one effective model: warm equals cold exactly

        for item in (fixture_dir / "adapters" / "v2").iterdir():
            shutil.copyfile(item, mutable / item.name)
        reload = {"lora_name": name, "lora_path": str(mutable), "load_inplace": True}
        await post_json(http, f"{url}/v1/load_lora_adapter", reload)

        warm = await complete(http, url, name, prompt)
        cold = await complete(http, url, name, prompt, cache_salt=cold_salt())
    finally:
        await post_json(http, f"{url}/v1/unload_lora_adapter", {"lora_name": name})

    assert warm.cached_tokens >= 384, "the warm request must hit the prefix cache"
    assert cold.cached_tokens == 0
    assert cold.text != v1_cold.text, "v2 must change the output, or the experiment proves nothing"
    assert not warm.agrees_with(cold), "warm (stale v1 prefix + v2) should disagree with cold v2"
    assert warm.max_logprob_diff(cold) > 1e-3
