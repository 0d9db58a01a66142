"""The plan's settings and the service's configuration name the same knobs: one default
each (they drifted once: evidence tokens 160 in the plan, 120 in the service)."""

from __future__ import annotations

import dataclasses

from ragline_services.orchestrator.run_context import Settings
from ragline_services.orchestrator.service import OrchestratorConfig


def test_a_setting_the_service_configures_has_the_service_default():
    configured = OrchestratorConfig.model_fields
    shared = [f for f in dataclasses.fields(Settings) if f.name in configured]
    assert len(shared) >= 10
    drifted = {
        f.name: (f.default, configured[f.name].get_default(call_default_factory=True))
        for f in shared
        if f.default != configured[f.name].get_default(call_default_factory=True)
    }
    assert drifted == {}
