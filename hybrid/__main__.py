from hybrid.cli import main

raise SystemExit(main())
