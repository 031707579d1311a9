from kv_mooncake.proxy.cli import main

main()
