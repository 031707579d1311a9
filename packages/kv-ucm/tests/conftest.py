import os
import tempfile

# UCM's logger writes to ./log unless UCM_LOG_PATH is set: keep it out of the working tree.
os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))
