"""Where the shared material lies: `shared/` stands beside the repository (CI copies it there)."""

import os
from pathlib import Path

FIXTURES = Path(
    os.environ.get(
        "LLAMA_FIXTURES",
        Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "llama-server",
    )
)
