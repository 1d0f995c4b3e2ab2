"""The wizard's step 2, device and memory: the device, dtype and budget fields, filled from the probe of this
machine (on a worker, once the loaded model has let go of its memory) and checked before step 3."""
from __future__ import annotations

from textual.screen import Screen
from textual.widgets import DataTable, Input, Label, Select, Static

from ...options import BUDGETS, budget_hint
from ...settings import load_settings
from .settings import field_error, parse_field, show_error

GIB = 2**30
UNLOAD_WAIT_S = 120  # at most this long for a reply in progress to end and the model to unload before probing


def _entered(budget: float | None) -> str:
    """A budget's field: the one the settings hold (`--setup` again), else empty."""
    return "" if budget is None else str(budget)


class BudgetsStep(Screen):
    """WizardScreen's step 2 (its state, `hardware` and `decisions` among it, is the screen's)."""

    def _probe(self) -> None:
        from ....engine import probe

        if self.memory_freed is not None:  # the free VRAM and RAM without the model that was loaded
            self.memory_freed.wait(UNLOAD_WAIT_S)
        try:
            hw = probe()
        except Exception as err:  # a locked-down machine (psutil refused, a broken driver): the budgets by hand
            self.app.call_from_thread(self.query_one("#hw-note", Static).update,
                                      f"cannot measure this machine ({type(err).__name__}: {err}): enter the budgets "
                                      "yourself, or leave them empty for what is free at start")
            return
        self.app.call_from_thread(self._prefill, hw)

    def _prefill(self, hw) -> None:
        from ....engine import best_gpu

        self.hardware = hw
        settings, _ = load_settings(self.path)  # `--setup` again: the budgets chosen before win over the probe
        vram, ram = self.query_one("#vram_budget_gib", Input), self.query_one("#ram_budget_gib", Input)
        self.query_one("#device", Input).value = settings.device or ""
        self.query_one("#dtype", Select).value = settings.dtype or "auto"
        self.query_one("#placement-note", Static).update(
            f"auto: the GPU ({best_gpu(hw.gpus).name}), in bfloat16 where it has it, else float16" if hw.gpus else
            "auto: the CPU (no NVIDIA GPU found), in float32 for quantized, small or bf16 models (bf16 weights kept), "
            "else the checkpoint's dtype")
        # what is free now is shown, not entered: saved as a budget, it would be a hard limit at every later start (a RAM
        # budget keeps the experts in RAM however little is free then)
        if hw.gpus:
            gpu = best_gpu(hw.gpus)
            vram.value = _entered(settings.vram_budget_gib)
            vram.placeholder = f"free at each start ({gpu.free_bytes / GIB:.1f} GiB now)"
            note = f"{gpu.name}: {gpu.free_bytes / GIB:.1f} of {gpu.total_bytes / GIB:.1f} GiB free. "
        else:
            vram.value, vram.disabled, vram.placeholder = "", True, "no GPU found"
            note = f"No NVIDIA GPU ({hw.gpu_note or 'none found'}): experts run on the CPU. "
        ram.value = _entered(settings.ram_budget_gib)
        ram.placeholder = f"free at each start ({hw.ram_available_bytes / GIB:.1f} GiB now)"
        note += f"RAM: {hw.ram_available_bytes / GIB:.1f} of {hw.ram_total_bytes / GIB:.1f} GiB available."
        self.query_one("#hw-note", Static).update(note)

    def _show_budget_hint(self, name: str, valid: bool = True) -> None:
        """A budget above what the probe found (the machine's RAM, its largest GPU), said under the field: not refused."""
        hw = self.hardware
        memory = (hw.ram_total_bytes, max((g.total_bytes for g in hw.gpus), default=None)) if hw else (None, None)
        show_error(self.query_one(f"#{name}-hint", Label), valid and budget_hint(name, self._budget(name), *memory) or None)

    def _budget(self, name: str) -> float | None:
        return parse_field(name, self.query_one(f"#{name}", Input).value)

    def _placement(self) -> dict[str, str | None]:
        """The device and dtype fields as settings values: None where they say auto (the default)."""
        device = self.query_one("#device", Input).value.strip()
        dtype = self.query_one("#dtype", Select).value
        return {"device": None if device in ("", "auto") else device, "dtype": None if dtype == "auto" else dtype}

    def _leave_budgets(self) -> None:
        errors = {name: field_error(name, self._budget(name)) for name in BUDGETS}
        errors["device"] = field_error("device", self._placement()["device"])
        for name, error in errors.items():
            self._say(f"#{name}-error", error or "")
        if not any(errors.values()):
            if self.decisions is not None and self._calibration_inputs() != self._calibrated_with:
                self.decisions, self.profile_path = None, ""  # budgets or device changed: the profile measured others
                self.query_one("#decisions", DataTable).clear()
            self._go(2)

    def _calibration_inputs(self) -> tuple:
        """What a calibration is measured for, besides the model: the budgets, the device and the dtype."""
        return (*(self._budget(name) for name in BUDGETS), *self._placement().values())
