# moechat installer for Windows (PowerShell 5.1+). Untested here: the project's machines have no
# Windows, so this script is kept deliberately simple. Safe to run again.
#
#   powershell -ExecutionPolicy Bypass -File installer\install.ps1 [-Dev]
#
# Creates %LOCALAPPDATA%\moechat\venv, installs PyTorch (the CUDA build for the newest CUDA the driver
# supports where an NVIDIA GPU is present, otherwise the CPU build; an installed torch is reused) and moechat, and adds the
# environment's Scripts folder to the user PATH.
param([switch]$Dev)
$ErrorActionPreference = "Stop"

$Src = Split-Path -Parent $PSScriptRoot
if (-not (Test-Path "$Src\pyproject.toml")) { throw "run this script from a moechat checkout" }
$Home_ = if ($env:MOECHAT_HOME) { $env:MOECHAT_HOME } else { "$env:LOCALAPPDATA\moechat" }
$Venv = "$Home_\venv"
$Py = "$Venv\Scripts\python.exe"

if (-not (Test-Path $Py)) {
    $Base = (Get-Command py -ErrorAction SilentlyContinue)
    if ($Base) { & py -3 -m venv $Venv } else { & python -m venv $Venv }
    if (-not (Test-Path $Py)) { throw "no Python 3.10+ found: install it from python.org and run again" }
}
& $Py -c "import sys; sys.exit(sys.version_info < (3, 10))"
if ($LASTEXITCODE -ne 0) {  # made from an older Python: removed, else every later run would reuse it
    $Found = & $Py -c "import sys; print(sys.version.split()[0])"
    Remove-Item -Recurse -Force $Venv
    throw "Python $Found is too old (moechat needs 3.10 or newer): install a newer one from python.org and run again"
}

# Windows PowerShell 5.1 turns a native command's redirected stderr into an error, fatal under "Stop"
$ErrorActionPreference = "Continue"
& $Py -c "import torch" 2>$null
$HasTorch = $LASTEXITCODE -eq 0
$ErrorActionPreference = "Stop"
if (-not $HasTorch) {
    $Gpu = Get-Command nvidia-smi -ErrorAction SilentlyContinue
    if ($Gpu) {
        Write-Host "moechat install: NVIDIA GPU found: installing the CUDA build of PyTorch"
        # pytorch.org's build for the newest CUDA the driver supports (12.8 -> cu128, then cu126, ...)
        $Driver = [version]"99.0"  # not read: try every index, newest first
        $Line = (& nvidia-smi) | Select-String "CUDA Version:\s*([0-9]+\.[0-9]+)"
        if ($Line) { $Driver = [version]$Line.Matches[0].Groups[1].Value }
        $Installed = $false
        foreach ($Tag in @("130", "128", "126", "124", "121", "118")) {
            $Need = [version]("{0}.{1}" -f $Tag.Substring(0, 2), $Tag.Substring(2))
            if ($Driver -lt $Need) { continue }
            & $Py -m pip install torch --index-url "https://download.pytorch.org/whl/cu$Tag"
            if ($LASTEXITCODE -eq 0) { $Installed = $true; break }
        }
        if (-not $Installed) {  # a driver older than every CUDA build: without this, no PyTorch at all and no error
            Write-Host "moechat install: no CUDA build of PyTorch for this driver: installing the CPU build (update the driver)"
            & $Py -m pip install torch
        }
    } else {
        Write-Host "moechat install: no NVIDIA GPU: installing the CPU build of PyTorch"
        & $Py -m pip install torch   # Windows wheels on PyPI are CPU-only
    }
    if ($LASTEXITCODE -ne 0) { throw "PyTorch did not install; see the messages above" }
}

$Target = if ($Dev) { "$Src[test,kernels]" } else { "$Src" }
& $Py -m pip install --quiet -e $Target
if ($LASTEXITCODE -ne 0) { throw "moechat did not install; see the messages above" }

$Scripts = "$Venv\Scripts"
$UserPath = [Environment]::GetEnvironmentVariable("Path", "User")
if (-not ($UserPath -split ";" | Where-Object { $_ -eq $Scripts })) {
    [Environment]::SetEnvironmentVariable("Path", "$UserPath;$Scripts", "User")
    Write-Host "moechat install: added $Scripts to your PATH (open a new terminal)"
}

# Native kernels, built now with this machine's C++ compiler (else on first use), as install.sh does. Optional: without
# one moechat runs on its PyTorch paths
$ErrorActionPreference = "Continue"
& $Py -m moechat.engine.native *> $null
$Built = $LASTEXITCODE -eq 0
$ErrorActionPreference = "Stop"
if ($Built) {
    Write-Host "moechat install: native kernels built"
} else {
    Write-Host ("moechat install: native CPU kernels not built (no C++ compiler? winget install " +
                "BrechtSanders.WinLibs.POSIX.UCRT, then run this again in a new terminal); moechat uses its PyTorch paths. " +
                "See: moechat doctor")
}
& "$Scripts\moechat.exe" --version
