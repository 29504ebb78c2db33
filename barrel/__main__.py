from barrel.cli import run

run()
