"""The OpenAI API over Ray Serve: one package so its shared Serve app (conftest `server`)
is torn down when the package ends, before other modules start their own."""
