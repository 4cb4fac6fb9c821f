import sys
from pathlib import Path

# Dense references live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
