import sys

from vllmfit.main import main

sys.exit(main())
