"""LoRA adapters on disk (`trainer.lora.sync: adapter`): each server swaps the adapter it
serves as `POLICY_ADAPTER` for the new version's, over SGLang's adapter routes.

Per server, while it is paused (abort mode, so no request holds the adapter):
  `/unload_lora_adapter {lora_name}`   the previous version's adapter; "does not exist" is fine
                                       (a server whose last swap failed between the two calls)
  `/load_lora_adapter {lora_name, lora_path}`
  `/update_weight_version {new_version}`   SGLang's adapter routes leave `weight_version`
                                       alone (only the `update_weights_*` routes and this one set
                                       it: tokenizer_control_mixin.py), and token versions are
                                       read from it.
Why always under an abort pause, whatever `controller.interrupt_mode` says (`pause_mode`; and
`controller.interruptible: false` is refused for such runs, launcher/config.py): SGLang's unload first unregisters the name, then waits for every request that
resolved it to finish (lora_registry.py `wait_for_unload`). Requests retracted or kept in place
across the pause still hold it, so the unload would wait for them while they wait for the
continue. And without a pause, a request arriving between the unload and the load finds the
name unregistered and has SGLang reload the *old* adapter under it (tokenizer_manager.py
`_resolve_lora_path`, from its `lora_ref_cache`), which makes the load fail. Paused, SGLang holds
new requests before they resolve an adapter name (`generate_request`), so the swap is atomic for
them. The directory stays on disk for the trainer's `keep_weights` versions, so the same message
catches up a restarted server (which starts with version 0's adapter under the name).
"""
from __future__ import annotations

from tandem.rollout.client import AdminClient, AdminError
from tandem.services.protocol import POLICY_ADAPTER, AdapterOnDisk

from ..registry import RegisteredServer
from .base import SyncRun, WeightApplier

NOT_LOADED = "does not exist"   # SGLang's unload of an unknown name (lora_registry.py `unregister`)


class AdapterApplier(WeightApplier):
    message = AdapterOnDisk
    replayable = True
    pause_mode = "abort"

    def check(self, msg: AdapterOnDisk) -> None:
        if msg.version < 0:
            raise ValueError(f"adapter_on_disk: version must be >= 0, got {msg.version}")
        if not msg.path:
            raise ValueError("adapter_on_disk: `path` (peft's adapter directory) must not be empty")

    async def update(self, run: SyncRun, servers: list[RegisteredServer], msg: AdapterOnDisk
                     ) -> list[RegisteredServer]:
        async def swap(admin: AdminClient) -> None:
            try:
                await admin.unload_lora_adapter(POLICY_ADAPTER, timeout_s=run.timeout_s)
            except AdminError as e:
                if NOT_LOADED not in e.detail:
                    raise
            await admin.load_lora_adapter(POLICY_ADAPTER, msg.path, timeout_s=run.timeout_s)
            await admin.update_weight_version(msg.version, timeout_s=run.timeout_s)
        return await run.phase("update", servers, swap)
