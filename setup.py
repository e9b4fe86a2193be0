"""Packaging for tiny_lm: every setting comes from settings.ini (the nbdev 2 convention)."""
from configparser import ConfigParser
from packaging.version import parse as parse_version  # pkg_resources is gone from setuptools >= 82
import setuptools

assert parse_version(setuptools.__version__) >= parse_version('36.2')

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable',
            '6 - Mature', '7 - Inactive']
py_versions = '3.11 3.12 3.13'.split()
lic = licenses[cfg['license'].lower()]
min_python = cfg['min_python']

requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
cloud_requirements = cfg.get('cloud_requirements', '').split()
test_requirements = cfg.get('test_requirements', '').split()
compile_requirements = cfg.get('compile_requirements', '').split()

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    license=lic[0],
    classifiers=[
        'Development Status :: ' + statuses[int(cfg['status'])],
        'Intended Audience :: ' + cfg['audience'].title(),
        'Natural Language :: ' + cfg['language'].title(),
        'License :: ' + lic[1],
    ] + ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['tiny_lm', 'tiny_lm.*']),
    include_package_data=True,
    package_data={'tiny_lm': ['texts/*', 'gpu_specs/*']},  # lesson texts; XLA's GPU descriptions (their README.md)
    install_requires=requirements,
    extras_require={'dev': dev_requirements + cloud_requirements + test_requirements, 'cloud': cloud_requirements,
                    'test': test_requirements, 'compile': compile_requirements},
    python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': cfg.get('console_scripts', '').split(), 'nbdev': [f'{cfg["lib_name"]}={cfg["lib_name"]}._modidx:d']},
    author=cfg['author'],
    author_email=cfg['author_email'],
    description=cfg['description'],
    keywords=cfg['keywords'],
)
