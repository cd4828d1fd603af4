"""The packaged app's entry point (packaging/deltadesk.spec freezes this file): the check of Qt's
X11 libraries (:mod:`app.platform_check`, which scripts/run runs for a checkout), then the app."""

import sys

from app import platform_check

if __name__ == "__main__":
    status = platform_check.main()
    if status:
        sys.exit(status)
    from app.__main__ import main

    sys.exit(main())
