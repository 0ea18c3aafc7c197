from layerwatch.cli import main

raise SystemExit(main())
