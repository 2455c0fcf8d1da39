"""``python -m nelssa.proxy.engine ARGS``: vLLM's OpenAI api_server (ARGS as for it), with the NELSSA
connector registered by name in vLLM's KVConnectorFactory first.

Why: in a MultiConnector, the API process rebuilds each child's KV-connector stats by the child's
class name (vLLM 0.26 ``multi_connector.py`` ``MultiConnector.build_kv_connector_stats`` ->
``KVConnectorFactory.get_connector_class_by_name``); a connector loaded through
``kv_connector_module_path`` is not in that registry, so the first stats of NelssaConnector beside
NixlConnector raise ``Connector 'NelssaConnector' is not registered`` in AsyncLLM's output handler and
the instance dies. ``register_connector`` is vLLM's public way to name a connector. (The plugin's
``register()`` is the better home for this line; until it does it, this wrapper does, and it is a
no-op once the name is registered.)
"""

from __future__ import annotations

import runpy


def register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    try:
        KVConnectorFactory.register_connector("NelssaConnector", "nelssa.vllm_plugin.connector", "NelssaConnector")
    except ValueError:
        pass  # already registered (by the plugin)


if __name__ == "__main__":
    register_connector()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
